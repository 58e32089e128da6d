"""The profile iterations' codec (``config.profile_codec``, deft.runtime.codecs.first_iteration) and the first
iteration's layout over several links (deft.runtime.layouts): the pure decisions, every branch.

Each expected outcome follows from the rule in the module docstring applied by hand to the numbers here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deft.config import DeftConfig
from deft.errors import ContractError, DeftError
from deft.preserver.codec_error import FP16_HEADROOM, FP16_MAX, GradientScale, judge, pick
from deft.runtime.codecs.first_iteration import (
    CodecDecision,
    TimedBroadcast,
    first_sends_codec,
    profile_iterations_codec,
    sample_coordinates,
    sampled_scale,
    screen_first_sends,
    speculative_codec,
)
from deft.runtime.layouts import balanced_links, warmup_layout

EPS = 0.01
# world 2, batch 32, |g|² 1, tr Σ 100: b |g|² / tr Σ = 0.32, delta_fp16 = 8 x 2^-22 x 1.32: accepted
QUIET = GradientScale(world=2, batch=32, mu=1.0, trace=100.0, max_abs=1.0)


def test_links_the_bound_and_the_preserver_accepting_codes_the_profile_in_fp16() -> None:
    # 2.5 s of all-reduce after the backward against 0.9 s of compute: the links are the bound
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=2.5, compute_s=0.9)
    assert d.codec == "fp16"
    assert d.delta == pytest.approx(8 * 2.0 ** -22 * 1.32)
    assert "2.5 s after the backward" in d.reason


def test_compute_the_bound_keeps_the_profile_exact() -> None:
    # 0.02 s after the backward of a 0.38 s iteration: at most 0.02 s saved, under 10 % (0.04 s)
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.02, compute_s=0.36, comm_s=0.3)
    assert d.codec == "" and "saves too little" in d.reason


def test_the_profile_is_coded_where_coding_saves_a_tenth_of_the_first_iteration() -> None:
    # 250 Mbit/s on the testbed, the first iteration's sends overlapped with its backward: 0.12 s after
    # it, 0.45 s of compute, a 0.30 s all-reduce predicted. Coding saves min(0.12, 0.15) = 0.12 s
    # against a bar of 10 % of 0.57 s = 0.057 s: coded (the old rule, exposed > compute, kept it exact)
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.12, compute_s=0.45, comm_s=0.3)
    assert d.codec == "fp16" and "saves up to 0.12 s" in d.reason
    # 1000 Mbit/s: 0.07 s after a 0.38 s backward, an 0.084 s all-reduce: at most 0.042 s against 0.045 s
    fast = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.07, compute_s=0.38, comm_s=0.084)
    assert fast.codec == "" and "0.042 s saved" in fast.reason
    # without a timed broadcast half the exposed time is what coding surely saves: 0.06 against 0.057
    assert profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.12, compute_s=0.45).codec == "fp16"
    assert profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.10,
                                    compute_s=0.45).codec == ""  # 0.05 < 0.055


def test_always_codes_whatever_the_times() -> None:
    assert profile_iterations_codec("always", pick(QUIET, EPS), exposed_s=0.0, compute_s=1.0).codec == "fp16"


def test_never_keeps_the_profile_exact() -> None:
    d = profile_iterations_codec("never", pick(QUIET, EPS), exposed_s=9.0, compute_s=0.1)
    assert d.codec == "" and "never" in d.reason


def test_the_preserver_refusing_keeps_the_profile_exact_and_says_why() -> None:
    d = profile_iterations_codec("always", pick(QUIET, 0.0), exposed_s=9.0, compute_s=0.1)  # epsilon 0: no codec
    assert d.codec == "" and "accepts no codec" in d.reason and "fp16" in d.reason and "bf16" in d.reason


def test_gradients_without_fp16_headroom_code_the_profile_in_bf16() -> None:
    big = GradientScale(world=2, batch=32, mu=1.0, trace=100.0, max_abs=FP16_MAX / FP16_HEADROOM)
    assert profile_iterations_codec("auto", pick(big, EPS), exposed_s=2.0, compute_s=1.0).codec == "bf16"


def test_the_record_round_trips_and_bad_records_are_refused() -> None:
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=2.5, compute_s=0.9)
    assert CodecDecision.from_dict(d.to_dict()) == d
    with pytest.raises(DeftError, match=r"profile_codec\.codec"):
        CodecDecision.from_dict({**d.to_dict(), "codec": "int4"})
    assert CodecDecision.from_dict({**d.to_dict(), "codec": "int8"}).codec == "int8"  # the profile may send int8
    with pytest.raises(DeftError, match=r"plan_info\.profile_codec"):
        CodecDecision.from_dict({"codec": "fp16"})


def test_a_record_with_the_first_sends_round_trips_and_a_bad_one_is_refused() -> None:
    first = first_sends_codec("auto", pick(QUIET, EPS), comm_s=1.4, compute_s=0.4)
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.1, compute_s=0.4, first_codec=first.codec)
    d = CodecDecision(d.codec, d.reason, d.exposed_s, d.compute_s, d.delta, first.to_dict())
    assert CodecDecision.from_dict(d.to_dict()) == d
    with pytest.raises(DeftError, match=r"profile_codec\.first"):
        CodecDecision.from_dict({**d.to_dict(), "first": "fp16"})
    old = {k: v for k, v in d.to_dict().items() if k != "first"}  # a checkpoint of before the first sends
    assert CodecDecision.from_dict(old).first is None


# -- the first iteration's own sends ---------------------------------------------------------------------
def test_judged_first_sends_stand_in_the_codec_the_preserver_accepts_whatever_the_measured_backward() -> None:
    d = first_sends_codec("auto", pick(QUIET, EPS), comm_s=1.4, compute_s=0.4)
    assert d.codec == "fp16" and "predicts 1.4 s (0.4 s of forward and backward" in d.reason
    assert "on a sample" in d.reason and d.delta == pytest.approx(8 * 2.0 ** -22 * 1.32)
    # the sends are on the wire once the screen at the first gradient judged them: a backward measured
    # longer than the predicted all-reduce (its one-off costs) does not send them again exact
    slow = first_sends_codec("auto", pick(QUIET, EPS), comm_s=1.48, compute_s=1.44)
    assert slow.codec == "fp16" and "1.44 s of forward and backward measured" in slow.reason


def test_the_first_sends_stay_exact_without_a_timed_broadcast_never_or_a_refusal() -> None:
    assert "init_sync off" in first_sends_codec("auto", pick(QUIET, EPS), comm_s=None, compute_s=0.4).reason
    assert first_sends_codec("auto", pick(QUIET, EPS), comm_s=None, compute_s=0.4).codec == ""
    assert first_sends_codec("always", pick(QUIET, EPS), comm_s=None, compute_s=0.4).codec == "fp16"
    assert first_sends_codec("never", pick(QUIET, EPS), comm_s=9.0, compute_s=0.1).codec == ""
    refused = first_sends_codec("always", pick(QUIET, 0.0), comm_s=9.0, compute_s=0.1)
    assert refused.codec == "" and "sampled gradients" in refused.reason


def test_the_screen_at_the_first_gradient_judges_above_three_times_the_time_to_it() -> None:
    # 0.1 s to the first gradient: about 0.3 s of forward and backward. A predicted 0.31 s all-reduce
    # could be the bound once the estimate is off by 2x (coding needs more than 0.6 s): judged.
    assert screen_first_sends("auto", comm_s=0.31, to_first_grad_s=0.1) is None
    # 0.3 s predicted, not more than the 0.3 s estimate: sent exact, not judged, and the record says why
    unjudged = screen_first_sends("auto", comm_s=0.3, to_first_grad_s=0.1)
    assert unjudged is not None and unjudged.codec == ""
    assert "cannot be the bound" in unjudged.reason and "3x the 0.1 s to the first gradient" in unjudged.reason
    assert "not judged" in unjudged.reason
    assert unjudged.exposed_s == 0.3 and unjudged.compute_s == pytest.approx(0.3)


def test_the_screen_leaves_the_sends_unjudged_without_a_broadcast_and_always_judges() -> None:
    unjudged = screen_first_sends("auto", comm_s=None, to_first_grad_s=0.1)
    assert unjudged is not None and unjudged.codec == "" and "init_sync off" in unjudged.reason
    assert screen_first_sends("always", comm_s=None, to_first_grad_s=0.1) is None
    assert screen_first_sends("always", comm_s=0.001, to_first_grad_s=9.0) is None


def test_the_speculative_codec_round_trips_and_a_bad_one_is_refused() -> None:
    d = replace(first_sends_codec("always", pick(QUIET, 0.0), comm_s=9.0, compute_s=0.1), speculative="fp16")
    assert d.codec == "" and CodecDecision.from_dict(d.to_dict()) == d  # sent again exact after fp16
    assert CodecDecision.from_dict({**d.to_dict(), "speculative": "int8"}).speculative == "int8"
    with pytest.raises(DeftError, match=r"profile_codec\.speculative"):
        CodecDecision.from_dict({**d.to_dict(), "speculative": "powersgd"})
    old = {k: v for k, v in d.to_dict().items() if k != "speculative"}  # a checkpoint of before speculation
    assert CodecDecision.from_dict(old).speculative == ""


def test_the_first_sends_speculate_in_int8_where_the_links_stay_the_bound_in_16_bits_in_fewer_bytes() -> None:
    # 1.4 s of predicted all-reduce: 0.7 s in 16 bits, above 0.4 s of forward and backward
    assert speculative_codec("auto", comm_s=1.4, compute_s=0.4, world=2) == "int8"
    assert speculative_codec("auto", comm_s=1.4, compute_s=0.4, world=3) == "int8"
    assert speculative_codec("auto", comm_s=1.4, compute_s=0.4, world=8) == "int8"  # the scatter path: ~1 B/element
    # all-gathered only (not gloo), as many bytes as fp16 at four ranks
    assert speculative_codec("auto", comm_s=1.4, compute_s=0.4, world=4, scatter_ok=False) == "fp16"
    # one-block buckets at eight ranks: either path sends more than fp16's 512 bytes
    assert speculative_codec("auto", comm_s=1.4, compute_s=0.4, world=8, numels=[256] * 10) == "fp16"
    # Before the plan 16 bits must outlast the whole compute: 0.5 s of 16-bit all-reduce against 0.4 s of
    # compute does; 0.4 s against 0.4 s does not (the plan weighs int8 there, from half the compute: the
    # GPT-2 at 2 x 250 Mbit/s, where int8 before the plan ran slower than 16 bits), nor 0.2 s
    assert speculative_codec("auto", comm_s=1.0, compute_s=0.4, world=2) == "int8"
    assert speculative_codec("auto", comm_s=0.8, compute_s=0.4, world=2) == "fp16"
    assert speculative_codec("auto", comm_s=0.4, compute_s=0.4, world=2) == "fp16"
    assert speculative_codec("auto", comm_s=None, compute_s=0.4, world=2) == "fp16"  # no timed broadcast
    # "always" codes whatever the timing: 16 bits, which no timing chooses
    assert speculative_codec("always", comm_s=1.4, compute_s=0.4, world=2) == "fp16"


def test_int8_sends_stand_where_int8_passes_on_the_sample_else_they_go_again_in_16_bits() -> None:
    ok, refused = judge("int8", PEAKY_OK, EPS), judge("int8", replace(QUIET, block_peak=1e6, raw_trace=100.0), EPS)
    kept = first_sends_codec("auto", pick(PEAKY_OK, EPS), comm_s=1.4, compute_s=0.4, int8=ok, speculative="int8")
    assert kept.codec == "int8" and kept.delta == pytest.approx(ok.delta) and "went in int8 and stand" in kept.reason
    again = first_sends_codec("auto", pick(QUIET, EPS), comm_s=1.4, compute_s=0.4, int8=refused, speculative="int8")
    assert again.codec == "fp16" and "went in int8, refused" in again.reason
    # 16-bit sends are not turned into int8 (their bytes are mostly on the wire by the verdict)
    sixteen = first_sends_codec("auto", pick(PEAKY_OK, EPS), comm_s=1.4, compute_s=0.4, int8=ok, speculative="fp16")
    assert sixteen.codec == "fp16"
    # a backward measured longer than the prediction (the testbed's 1.44 s against 1.48 s): int8 stands
    assert first_sends_codec("auto", pick(PEAKY_OK, EPS), comm_s=1.48, compute_s=1.44, int8=ok,
                             speculative="int8").codec == "int8"
    # "never": exact, whatever int8's verdict
    assert first_sends_codec("never", pick(PEAKY_OK, EPS), comm_s=9.0, compute_s=0.1, int8=ok,
                             speculative="int8").codec == ""
    # epsilon 0 refuses every codec: exact
    assert first_sends_codec("always", pick(PEAKY_OK, 0.0), comm_s=9.0, compute_s=0.1,
                             int8=judge("int8", PEAKY_OK, 0.0), speculative="int8").codec == ""


def test_coded_first_sends_make_the_profile_skip_the_time_screen() -> None:
    # the first iteration ran coded, so its short exposed time says nothing: the codec stays if accepted
    d = profile_iterations_codec("auto", pick(QUIET, EPS), exposed_s=0.1, compute_s=0.4, first_codec="fp16")
    assert d.codec == "fp16" and "first iteration was sent in fp16" in d.reason
    refused = profile_iterations_codec("auto", pick(QUIET, 0.0), exposed_s=0.1, compute_s=0.4, first_codec="fp16")
    assert refused.codec == "" and "accepts no codec" in refused.reason


def test_the_broadcast_predicts_the_all_reduce_over_the_links() -> None:
    bcast = TimedBroadcast(seconds=2.8, nbytes=17_600_000)
    # 2 ranks: a ring all-reduce moves 2 x 1/2 = 1 x the bytes, halved over two links
    assert bcast.allreduce_s(17_600_000, world=2, links=2) == pytest.approx(1.4)
    # 4 ranks, half the bytes, one link: 2.8 x 0.5 x 1.5
    assert bcast.allreduce_s(8_800_000, world=4, links=1) == pytest.approx(2.1)
    assert TimedBroadcast(seconds=1.0, nbytes=0).allreduce_s(100, world=2, links=1) == 0.0


def test_the_sampled_scale_is_the_estimators_rule_by_hand() -> None:
    # two ranks, four coordinates sampled of a gradient of 8: f = 2
    samples = torch.tensor([[1.0, 2.0, 0.0, 1.0], [3.0, 0.0, 2.0, 1.0]], dtype=torch.float64)
    # mean_r |g_r|^2 = 2 x (6 + 14) / 2 = 20; |g_bar|^2 = 2 x (4 + 1 + 1 + 1) = 14
    # tr S = (20 - 14) x R b / (R - 1) = 6 x 2 x 3 = 36; mu = 14 - 36 / 6 = 8
    scale = sampled_scale(samples, numel=8, batch=3, max_abs=5.0, margin=1.0, z=0.0)
    assert scale == GradientScale(world=2, batch=3, mu=8.0, trace=36.0, max_abs=5.0)
    # per coordinate: the spread over ranks 1, 1, 1, 0, each x n R b / (R - 1) = 8 x 6: 48, 48, 48, 0
    # (mean 36); their standard deviation 24, the mean's standard error 24 / sqrt(4) = 12
    one_se = sampled_scale(samples, numel=8, batch=3, max_abs=5.0, margin=1.0, z=1.0)
    assert one_se is not None and one_se.trace == pytest.approx(24.0) and one_se.mu == pytest.approx(8.0)
    halved = sampled_scale(samples, numel=8, batch=3, max_abs=5.0, margin=2.0, z=1.0)
    assert halved is not None and halved.trace == pytest.approx(12.0)


def test_a_sample_that_cannot_bound_the_noise_away_from_zero_gives_no_scale() -> None:
    samples = torch.tensor([[1.0, 2.0, 0.0, 1.0], [3.0, 0.0, 2.0, 1.0]], dtype=torch.float64)
    # 36 - 3 x 12 = 0: three standard errors leave no noise to hide a rounding in
    assert sampled_scale(samples, numel=8, batch=3, max_abs=5.0, margin=1.0, z=3.0) is None


def test_a_sample_of_every_coordinate_has_no_sampling_error() -> None:
    samples = torch.tensor([[1.0, 2.0, 0.0, 1.0], [3.0, 0.0, 2.0, 1.0]], dtype=torch.float64)
    # numel = k = 4: f = 1, tr S = (10 - 7) x 6 = 18 whatever z; mu = 7 - 18 / 6 = 4
    scale = sampled_scale(samples, numel=4, batch=3, max_abs=5.0, margin=1.0, z=4.0)
    assert scale is not None and scale.trace == pytest.approx(18.0) and scale.mu == pytest.approx(4.0)


def _heavy_tailed_draws(sigma: torch.Tensor, draws: int, batch: int = 32) -> list[tuple[float | None, float]]:
    """Per draw of two ranks' local gradients with per-coordinate noise ``sigma``: the default sampled
    trace and the sample's plain estimate, each over the whole gradient's own trace."""
    gen = torch.Generator().manual_seed(3)
    numel = sigma.numel()
    idx = sample_coordinates(numel)
    out: list[tuple[float | None, float]] = []
    for _ in range(draws):
        local = torch.randn(numel, generator=gen, dtype=torch.float64) * 0.1 \
            + sigma * torch.randn(2, numel, generator=gen, dtype=torch.float64)
        whole = float((local.square().mean(dim=0) - local.mean(dim=0).square()).sum()) * 2 * batch  # R b / (R - 1)
        bound = sampled_scale(local[:, idx], numel, batch, 1.0, margin=1.0)
        plain = sampled_scale(local[:, idx], numel, batch, 1.0, margin=1.0, z=0.0)
        assert plain is not None
        out.append((None if bound is None else bound.trace / whole, plain.trace / whole))
    return out


@pytest.mark.slow
def test_the_sampled_noise_bound_stays_below_a_heavy_tailed_gradients_noise() -> None:
    # 1M coordinates, the noise's scale log-normal (sigma 1.5: a few coordinates far noisier than the rest)
    gen = torch.Generator().manual_seed(0)
    sigma = torch.exp(1.5 * torch.randn(1_000_000, generator=gen, dtype=torch.float64))
    draws = _heavy_tailed_draws(sigma, 20)
    assert max(plain for _, plain in draws) > 1.05  # the plain estimate overshoots in some draws ...
    usable = [bound for bound, _ in draws if bound is not None]
    assert len(usable) == len(draws) and max(usable) < 1.0  # ... the bound in none, and it judges every draw


def test_a_sample_ruled_by_a_few_coordinates_is_not_judged() -> None:
    # the noise's scale Pareto with index 1.5: its square has no mean, a handful of coordinates hold most
    # of the trace, and the sample's plain estimate is off by up to several times either way
    gen = torch.Generator().manual_seed(1)
    sigma = torch.rand(1_000_000, generator=gen, dtype=torch.float64) ** (-1.0 / 1.5)  # inverse CDF
    draws = _heavy_tailed_draws(sigma, 5)
    assert min(plain for _, plain in draws) > 1.5  # the plain estimate: well above the whole in every draw
    assert all(bound is None for bound, _ in draws)


@pytest.mark.parametrize(("samples", "batch", "max_abs"), [
    (torch.tensor([[1.0, float("inf")], [0.0, 1.0]], dtype=torch.float64), 3, 1.0),  # an fp16 overflow
    (torch.tensor([[1.0, 2.0], [1.0, 2.0]], dtype=torch.float64), 3, 2.0),  # no spread between ranks
    (torch.tensor([[1.0, 2.0], [0.0, 2.0]], dtype=torch.float64), None, 2.0),  # batch size unknown
    (torch.tensor([[1.0, 2.0]], dtype=torch.float64), 3, 2.0),  # one rank
    (torch.tensor([[1.0, 2.0], [0.0, 2.0]], dtype=torch.float64), 3, float("nan")),
])
def test_a_sample_that_cannot_be_judged_gives_no_scale(samples: torch.Tensor, batch: int | None,
                                                      max_abs: float) -> None:
    assert sampled_scale(samples, numel=10, batch=batch, max_abs=max_abs) is None


def test_the_sampled_coordinates_are_the_same_everywhere_and_in_range() -> None:
    a, b = sample_coordinates(10_000_000, 1000), sample_coordinates(10_000_000, 1000)
    assert torch.equal(a, b) and a.numel() == 1000 and int(a.min()) >= 0 and int(a.max()) < 10_000_000
    assert torch.equal(sample_coordinates(5, 1000), torch.arange(5))  # a small gradient: all of it


def test_config_names_the_field() -> None:
    with pytest.raises(ContractError, match="profile_codec"):
        DeftConfig(profile_codec="sometimes")


# -- the first iteration's layout ----------------------------------------------------------------
def test_the_first_layout_cuts_a_dominant_parameter_so_both_links_carry_half() -> None:
    # 4 MB + 3 x 40 KB: total 4,120,000 bytes, limit = total / 4 = 1,030,000 bytes; the 1,000,000-element
    # parameter (4,000,000 bytes) becomes ceil(4,000,000 / 1,030,000) = 4 pieces of 250,000 elements
    params = [torch.zeros(10_000), torch.zeros(1_000_000), torch.zeros(10_000), torch.zeros(10_000)]
    order = [3, 2, 1, 0]
    whole = warmup_layout(order, list("abcd"), params, 25.0, False)
    split = warmup_layout(order, list("abcd"), params, 25.0, False, split_over=2)
    assert 1_000_000 in whole.bucket_numel
    assert split.bucket_numel == (20_000, 250_000, 250_000, 250_000, 250_000, 10_000)
    links = balanced_links(split.bucket_nbytes(), ("a", "b"))
    load = {k: sum(n for n, lk in zip(split.bucket_nbytes(), links, strict=True) if lk == k) for k in ("a", "b")}
    assert load == {"a": 2_080_000, "b": 2_040_000}  # 80 KB + 2 pieces, and 2 pieces + 40 KB


def test_one_link_and_chained_hooks_keep_torchs_whole_parameters() -> None:
    params = [torch.zeros(10_000), torch.zeros(1_000_000)]
    one = warmup_layout([1, 0], ["a", "b"], params, 25.0, False, split_over=1)
    chained = warmup_layout([1, 0], ["a", "b"], params, 25.0, True, split_over=2)
    assert one.bucket_numel == (1_000_000, 10_000)
    assert chained.bucket_numel == (1_000_000, 10_000)  # torch's 1 MB first bucket: the whole 4 MB parameter


def test_balanced_links_sends_each_bucket_to_the_least_loaded_link() -> None:
    # 5 -> a (0, 0: first), 3 -> b, 3 -> b (a 5, b 3), 1 -> a (a 5, b 6)
    assert balanced_links([5, 3, 3, 1], ("a", "b")) == ("a", "b", "b", "a")


# -- int8 for the profile iterations ------------------------------------------------------------------------
# int8's delta = b P / (4 x 127² x tr Σ): 32 x 10 / (64516 x 100) = 5e-5 (accepted); with P = 1e6, 5 (refused)
PEAKY_OK = replace(QUIET, block_peak=10.0, raw_trace=100.0)


def test_the_profile_iterations_go_int8_where_it_passes_and_16_bits_leave_the_links_the_bound() -> None:
    int8 = judge("int8", PEAKY_OK, EPS)
    assert int8.accepted
    # the all-reduce predicts 1.4 s: 0.7 s in 16 bits, above the 0.4 s of forward and backward
    d = profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=1.0, compute_s=0.4, comm_s=1.4, int8=int8)
    assert d.codec == "int8" and d.delta == pytest.approx(int8.delta) and "int8" in d.reason
    # 0.35 s of all-reduce: 0.175 s in 16 bits, under half the compute: fp16 hides, int8 would only cost its codec
    d = profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=0.5, compute_s=0.4, comm_s=0.35, int8=int8)
    assert d.codec == "fp16"
    # 0.7 s: 0.35 s in 16 bits, above half the 0.4 s but under all of it: 16 bits before the plan (the plan
    # weighs int8 with its measured costs); 0.9 s, 0.45 s in 16 bits, outlasts the compute: int8
    assert profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=0.5, compute_s=0.4, comm_s=0.7,
                                    int8=int8).codec == "fp16"
    assert profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=0.5, compute_s=0.4, comm_s=0.9,
                                    int8=int8).codec == "int8"


def test_the_profile_iterations_continue_in_int8_where_the_first_iterations_sends_stood_in_it() -> None:
    int8 = judge("int8", PEAKY_OK, EPS)
    # the first backward measured 1.6 s against a 1.48 s all-reduce: half of it is not above half that, but
    # the screen at the first gradient judged int8 to pay and its sends stood: the same codec goes on
    d = profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=0.2, compute_s=1.6, first_codec="int8",
                      comm_s=1.48, int8=int8)
    assert d.codec == "int8" and d.delta == pytest.approx(int8.delta) and "as the first iteration's" in d.reason
    # a 16-bit first iteration does not make the profile int8 where the measured times do not
    sixteen = profile_iterations_codec("auto", pick(PEAKY_OK, EPS), exposed_s=0.2, compute_s=1.6, first_codec="fp16",
                            comm_s=1.48, int8=int8)
    assert sixteen.codec == "fp16"
    # int8 refused on the statistics (a resumed run's), or "never": not int8
    refused = judge("int8", replace(QUIET, block_peak=1e6, raw_trace=100.0), EPS)
    assert profile_iterations_codec("auto", pick(QUIET, EPS), 0.2, 1.44, first_codec="int8", comm_s=1.48,
                         int8=refused).codec == "fp16"
    assert profile_iterations_codec("never", pick(PEAKY_OK, EPS), 0.2, 1.44, first_codec="int8", comm_s=1.48,
                         int8=int8).codec == ""


def test_the_profile_iterations_stay_16_bit_where_int8_is_refused_unjudged_or_nothing_is_coded() -> None:
    refused = judge("int8", replace(QUIET, block_peak=1e6, raw_trace=100.0), EPS)
    assert not refused.accepted
    kept = profile_iterations_codec("auto", pick(QUIET, EPS), 1.0, 0.4, comm_s=1.4, int8=refused)
    assert kept.codec == "fp16" and "int8 not taken" in kept.reason and "outside 1 +- 0.01" in kept.reason
    assert profile_iterations_codec("auto", pick(QUIET, EPS), 1.0, 0.4, comm_s=1.4, int8=None).codec == "fp16"
    # no timed broadcast: the links' bound in 16 bits unknown
    assert profile_iterations_codec("auto", pick(QUIET, EPS), 1.0, 0.4, comm_s=None,
                                    int8=judge("int8", PEAKY_OK, EPS)).codec == "fp16"
    never = profile_iterations_codec("never", pick(PEAKY_OK, EPS), 1.0, 0.4, comm_s=1.4,
                                     int8=judge("int8", PEAKY_OK, EPS))
    assert never.codec == ""
    # "always" codes whatever the timing, so it keeps to 16 bits (int8 is chosen by the timing)
    always = profile_iterations_codec("always", pick(PEAKY_OK, EPS), 1.0, 0.4, comm_s=1.4,
                                      int8=judge("int8", PEAKY_OK, EPS))
    assert always.codec == "fp16"


def test_the_sampled_scale_carries_the_block_peak_against_the_samples_euclidean_noise() -> None:
    samples = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 1.0, 1.0, -0.5]], dtype=torch.float64)
    with_peak = sampled_scale(samples, 4, 8, 2.0, block_peak=7.0)
    assert with_peak is not None and with_peak.block_peak == 7.0 and with_peak.raw_trace == with_peak.trace
    without = sampled_scale(samples, 4, 8, 2.0)
    assert without is not None and without.block_peak is None and not judge("int8", without, EPS).accepted
