"""The preserver's statistics and the first iteration's screen at four ranks: each uses the world size it
is given (the rows gathered), and the global batch grows with it. Every case below would come out wrong
(by the factor named beside it) if the world size were taken as 2."""

from __future__ import annotations

import math

import pytest
import torch

from deft.preserver.codec_error import GradientScale, judge, variance_bound
from deft.preserver.noise import LocalStats, step_estimate
from deft.runtime.codecs.first_iteration import TimedBroadcast, sampled_scale

WORLD, BATCH, D = 4, 8, 4000
SIGMA = 0.5  # per-sample noise of every coordinate: tr Σ = D SIGMA²


def local_gradients(gen: torch.Generator, signal: torch.Tensor) -> torch.Tensor:
    """``WORLD`` local gradients, each the mean of ``BATCH`` samples: ``g + e_r``, ``Cov e_r = Σ / BATCH``."""
    return signal + SIGMA / math.sqrt(BATCH) * torch.randn(WORLD, D, generator=gen, dtype=torch.float64)


def test_noise_estimator_at_four_ranks_recovers_the_trace_and_the_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    signal = 0.05 * torch.randn(D, generator=gen, dtype=torch.float64)
    traces, mus = [], []
    for _ in range(400):
        g = local_gradients(gen, signal)
        parts = [LocalStats(sq_norm=float(row.square().sum()), proj_a=None, proj_b=None, batch=BATCH) for row in g]
        est = step_estimate(parts, float(g.mean(0).square().sum()))
        assert est is not None and est.parts == WORLD
        traces.append(est.trace)
        mus.append(est.mu)
    # R = 2's Bessel factor, 2 / 1 against 4 / 3, would give 1.5 x the trace
    assert sum(traces) / len(traces) == pytest.approx(D * SIGMA ** 2, rel=0.03)
    assert sum(mus) / len(mus) == pytest.approx(float(signal.square().sum()), rel=0.1)


def test_first_iterations_sample_at_four_ranks_recovers_the_trace() -> None:
    gen = torch.Generator().manual_seed(1)
    signal = 0.05 * torch.randn(D, generator=gen, dtype=torch.float64)
    g = local_gradients(gen, signal)
    scale = sampled_scale(g, D, BATCH, max_abs=1.0, margin=1.0, z=0.0)
    assert scale is not None and scale.world == WORLD and scale.batch == BATCH
    assert scale.trace == pytest.approx(D * SIGMA ** 2, rel=0.05)  # 1.5 x with R = 2's factor
    # |g|² net of the averaged gradient's noise tr Σ / (R b): R = 2 would subtract twice as much
    assert scale.mu == pytest.approx(float(signal.square().sum()), rel=0.15)


def test_codec_bounds_at_four_ranks_are_against_the_averaged_gradients_noise() -> None:
    # fp16: R³ u² (b |g|² / tr Σ + 1): 8 times R = 2's
    def at(world: int) -> GradientScale:
        return GradientScale(world=world, batch=BATCH, mu=1.0, trace=10.0, max_abs=1.0, block_peak=5.0, raw_trace=10.0)
    assert variance_bound("fp16", at(4)) == pytest.approx(8 * variance_bound("fp16", at(2)))
    # int8: the scatter path's second rounding, (R + 1) against R = 2's 1
    assert variance_bound("int8", at(4)) == pytest.approx(5 * variance_bound("int8", at(2)))


def test_first_iterations_screen_scales_the_broadcast_to_the_ring_all_reduce_at_n() -> None:
    # a broadcast moves the bytes once; a ring all-reduce moves 2 (R - 1) / R of them through each rank
    timed = TimedBroadcast(seconds=0.1, nbytes=10_000)
    assert timed.allreduce_s(10_000, 2, 1) == pytest.approx(0.1)
    assert timed.allreduce_s(10_000, 4, 1) == pytest.approx(0.15)  # R = 2 would say 0.1
    assert timed.allreduce_s(10_000, 8, 2) == pytest.approx(0.0875)


def test_first_iterations_int8_verdict_at_four_ranks_charges_the_second_rounding() -> None:
    # a sample whose int8 bound is 0.01 of the noise with one rounding: 1 / sqrt(1.01) passes epsilon
    # 0.01; at four ranks the reduce-scatter path's (R + 1) = 5 roundings' worth, 0.05, does not
    gen = torch.Generator().manual_seed(2)
    g4 = local_gradients(gen, torch.zeros(D, dtype=torch.float64))
    probe = sampled_scale(g4, D, BATCH, max_abs=1.0, margin=1.0, z=0.0, block_peak=1.0)
    assert probe is not None and probe.raw_trace is not None
    peak = 0.01 * 4 * 127 ** 2 * probe.raw_trace / BATCH  # delta = b P / (4 127² tr Σ) = 0.01 at one rounding
    four = sampled_scale(g4, D, BATCH, max_abs=1.0, margin=1.0, z=0.0, block_peak=peak)
    two = sampled_scale(g4[:2], D, BATCH, max_abs=1.0, margin=1.0, z=0.0, block_peak=peak)
    assert four is not None and two is not None
    assert judge("int8", four, 0.01).delta == pytest.approx(0.05)
    assert not judge("int8", four, 0.01).accepted
    assert judge("int8", two, 0.01).delta == pytest.approx(0.01 * four.raw_trace / two.raw_trace)
