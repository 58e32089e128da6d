"""deft.runtime.local_period: H_0 from measurements and AdaComm's rule, every branch, with numbers worked
out by hand from the formulas in the module docstring."""

from __future__ import annotations

import math

import pytest

from deft.runtime.local_period import (
    EXPOSED_FRACTION,
    HISTORY_LIMIT,
    AdaComm,
    Measurements,
    adacomm_period,
    initial_period,
    loss_problem,
    period_floor,
)


def test_exposed_time_and_step_time_follow_the_model() -> None:
    m = Measurements(compute_s=0.2, allreduce_s=1.0, overlap_steps=2)
    assert m.exposed_s == pytest.approx(0.6)  # 1.0 - 2 x 0.2
    assert m.step_s(3) == pytest.approx(0.2 + 0.6 / 3)
    assert Measurements(0.2, 0.3, 2).exposed_s == 0.0  # hidden behind 0.4 s of compute


@pytest.mark.parametrize(("a", "d", "h0"), [
    (0.05, 1, 1),   # a <= D c: nothing exposed -> the smallest period
    (0.1, 1, 1),    # a == D c exactly
    (0.15, 2, 2),   # hidden (0.15 <= 2 x 0.1), but the overlap needs H >= D = 2
    (0.0, 0, 1),    # without overlap, a free averaging
])
def test_a_hidden_averaging_gives_the_smallest_period(a: float, d: int, h0: int) -> None:
    assert initial_period(Measurements(0.1, a, d), h_max=16) == h0


def test_a_costly_averaging_gives_h_max() -> None:
    # e = 10 - 0.1 = 9.9 s exposed, f c = 0.01 s: H >= 990, far above H_max
    assert initial_period(Measurements(0.1, 10.0, 1), h_max=16) == 16


@pytest.mark.parametrize(("c", "a", "d", "h0"), [
    # e = 1.0 - 0.2 = 0.8, f c = 0.1 x 0.2 = 0.02: H >= 40 (exactly 40 allowed: 0.8 / 40 = 0.02)
    (0.2, 1.0, 1, 40),
    # no overlap: e = a = 1.0, f c = 0.02: H >= 50 (the quotient rounds to 49.99...; 49 is not enough)
    (0.2, 1.0, 0, 50),
    # e = 0.35 - 2 x 0.1 = 0.15, f c = 0.01: H >= 15
    (0.1, 0.35, 2, 15),
    # e = 0.125 - 0.1 = 0.025, f c = 0.01: H >= 2.5 -> 3
    (0.1, 0.125, 1, 3),
])
def test_h0_is_the_smallest_period_with_exposed_time_within_the_fraction(c: float, a: float, d: int,
                                                                         h0: int) -> None:
    assert EXPOSED_FRACTION == 0.1
    m = Measurements(c, a, d)
    assert initial_period(m, h_max=64) == h0
    assert m.exposed_s / h0 <= EXPOSED_FRACTION * c * (1 + 1e-12)
    assert h0 > max(1, d) and m.exposed_s / (h0 - 1) > EXPOSED_FRACTION * c  # one less is not enough
    assert initial_period(m, h_max=h0 - 1) == h0 - 1  # clipped to H_max


def test_a_larger_fraction_allows_a_shorter_period() -> None:
    m = Measurements(0.2, 1.0, 1)  # e = 0.8
    assert initial_period(m, h_max=64, fraction=0.5) == 8  # 0.8 / (0.5 x 0.2)


@pytest.mark.parametrize(("ratio", "h0", "h_min", "want"), [
    (1.0, 8, 1, 8),         # the loss of H_0's point: H_0
    (0.25, 8, 1, 4),        # sqrt(1/4) x 8
    (0.5, 8, 1, 6),         # ceil(0.7071 x 8 = 5.66)
    (0.01, 8, 1, 1),        # ceil(0.1 x 8 = 0.8) = 1
    (0.0001, 8, 3, 3),      # ceil(0.08) = 1, clipped up to h_min (the overlap's D)
    (4.0, 8, 1, 8),         # the loss rose: never above H_0
    (0.0, 8, 2, 2),         # a zero loss: the floor
])
def test_adacomm_rule_decays_with_the_loss_and_is_clipped(ratio: float, h0: int, h_min: int, want: int) -> None:
    assert adacomm_period(h0, 2.0, 2.0 * ratio, h_min) == want
    assert want == min(h0, max(h_min, math.ceil(math.sqrt(ratio) * h0)))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: Measurements(0.0, 1.0, 1), "compute_s"),
    (lambda: Measurements(math.nan, 1.0, 1), "compute_s"),
    (lambda: Measurements(0.1, -1.0, 1), "allreduce_s"),
    (lambda: Measurements(0.1, math.inf, 1), "allreduce_s"),
    (lambda: Measurements(0.1, 1.0, -1), "overlap_steps"),
    (lambda: initial_period(Measurements(0.1, 1.0, 4), h_max=3), "h_max"),
    (lambda: initial_period(Measurements(0.1, 1.0, 1), h_max=8, fraction=0.0), "fraction"),
    (lambda: adacomm_period(4, 0.0, 1.0, 1), "F_0"),
    (lambda: adacomm_period(4, 1.0, math.nan, 1), "F_l"),
    (lambda: adacomm_period(4, 1.0, -0.5, 1), "F_l"),
    (lambda: adacomm_period(4, 1.0, 0.5, 0), "h_min"),
    (lambda: adacomm_period(2, 1.0, 0.5, 3), "h_max"),
    (lambda: AdaComm(h_max=2, h_min=3), "h_max"),
])
def test_bad_inputs_say_what_is_wrong(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]


def test_loss_problem_names_each_reason() -> None:
    assert loss_problem(1.0, 0.5) is None
    assert "no loss reported" in str(loss_problem(1.0, None))
    assert "no F_0" in str(loss_problem(None, 0.5))
    assert "F_0 = -1.0" in str(loss_problem(-1.0, 0.5))


def test_period_floor_is_the_overlap() -> None:
    assert [period_floor(d) for d in (0, 1, 2, 5)] == [1, 1, 2, 5]


def test_adacomm_runs_at_h_max_until_h0_then_follows_the_rule() -> None:
    ada = AdaComm(h_max=8, h_min=1)
    assert (ada.h, ada.h0) == (8, None)
    # e = 0.45 - 0.05 = 0.4, f c = 0.005: H_0 = 80, clipped to 8
    assert ada.start(step=7, compute_s=0.05, allreduce_s=0.45, overlap_steps=1, loss=2.0) == 8
    assert (ada.h0, ada.f0) == (8, 2.0)
    assert ada.adapt(15, 0.5) == 4  # sqrt(1/4) x 8
    assert ada.adapt(19, 3.0) == 8  # the loss rose: back to H_0, never above
    assert ada.adapt(27, None) == 8  # no loss: unchanged, and the note says why
    assert ada.note is not None and "no loss reported" in ada.note
    assert [(c.step, c.h, c.ratio) for c in ada.history] == [(7, 8, 1.0), (15, 4, 0.25), (19, 8, 1.5), (27, 8, None)]


def test_adacomm_without_losses_at_h0_takes_f0_from_the_first_loss() -> None:
    ada = AdaComm(h_max=8, h_min=2)
    assert ada.start(step=3, compute_s=0.1, allreduce_s=0.0, overlap_steps=2, loss=None) == 2  # hidden: h_min
    assert ada.f0 is None and ada.note is not None
    ada = AdaComm(h_max=8, h_min=1)
    assert ada.start(step=7, compute_s=0.1, allreduce_s=5.0, overlap_steps=1, loss=None) == 8
    assert ada.adapt(15, 4.0) == 8 and ada.f0 == 4.0  # F_0 from here on
    assert ada.adapt(23, 1.0) == 4
    assert ada.adapt(27, -1.0) == 4 and "not a finite number" in str(ada.note)  # unusable: unchanged


def test_adacomm_without_a_timed_step_starts_at_h_max() -> None:
    ada = AdaComm(h_max=8, h_min=1)  # a hidden averaging would give 1; no timed step gives H_max
    assert ada.start(step=0, compute_s=0.0, allreduce_s=0.0, overlap_steps=1, loss=1.0) == 8
    assert ada.measured is None and ada.h0 == 8


def test_adacomm_record_round_trips_and_keeps_the_latest_history() -> None:
    ada = AdaComm(h_max=8, h_min=1)
    ada.start(step=7, compute_s=0.05, allreduce_s=0.45, overlap_steps=1, loss=2.0)
    for i in range(HISTORY_LIMIT + 5):
        ada.adapt(8 + i, 2.0 / (1 + i))
    assert len(ada.history) == HISTORY_LIMIT
    assert ada.history[-1].step == 8 + HISTORY_LIMIT + 4
    back = AdaComm.from_json(ada.to_json())
    assert back == ada
    with pytest.raises(KeyError):
        AdaComm.from_json({"H_max": 8})
