"""The links' drag (:mod:`deft.profiler.drag`): sends slowed by the compute beside them, fitted from busy
groups beside and away from the compute; by hand, on every branch (fitted, clamped, no drag, groups too
alike, groups that cannot tell the drag from the transfer times)."""

from __future__ import annotations

import pytest

from deft.profiler.drag import MAX_DRAG, MIN_SHARE_SPREAD, DragFit, DragGroup, fit_drag, group_beta

MB = 1_000_000
MS = 1e-3


def _exact(k: float) -> dict[str, list[DragGroup]]:
    """alpha 1 ms on both links; a: 10 ms per MB, b: 20 ms per MB; ``T = alpha m + beta B + k o``."""
    def g(m: int, mb: int, beta_ms: float, beside_ms: float) -> DragGroup:
        return DragGroup(m, mb * MB, (m + beta_ms * mb + k * beside_ms) * MS, beside_ms * MS)
    return {"a": [g(1, 1, 10, 0), g(1, 2, 10, 20)], "b": [g(1, 1, 20, 10), g(2, 1, 20, 0)]}


def test_the_drag_and_each_links_transfer_time_by_hand() -> None:
    # k = 0.5 (a send at half speed beside the compute): drag 1; the betas as made
    fit = fit_drag(_exact(0.5), {"a": MS, "b": MS})
    assert fit.drag == pytest.approx(1.0) and fit.k == pytest.approx(0.5) and fit.reason == ""
    assert [group_beta(_exact(0.5)[lk], MS, fit.k) for lk in "ab"] == pytest.approx([10 * MS / MB, 20 * MS / MB])
    # a's second group: 31 ms, 20 of them beside the compute: 21 ms with the cores free
    assert fit.free_seconds(_exact(0.5)["a"][1]) == pytest.approx(21 * MS)


def test_a_drag_beyond_the_cap_is_clamped_and_the_betas_fitted_again() -> None:
    k_cap = MAX_DRAG / (1 + MAX_DRAG)
    groups = _exact(0.95)
    fit = fit_drag(groups, {"a": MS, "b": MS})
    assert fit.drag == pytest.approx(MAX_DRAG) and fit.k == pytest.approx(k_cap)
    assert group_beta(groups["a"], MS, fit.k) > 10 * MS / MB  # the drag the cap leaves is charged to the transfer


def test_groups_no_slower_beside_the_compute_have_no_drag() -> None:
    groups = _exact(-0.2)
    fit = fit_drag(groups, {"a": MS, "b": MS})
    assert (fit.drag, fit.k) == (0.0, 0.0) and "no drag" in fit.reason


def test_groups_alike_beside_the_compute_leave_the_drag_unfitted() -> None:
    # every group all beside the compute: the drag and beta cannot be told apart
    groups = {"a": [DragGroup(1, MB, 0.030, 0.030), DragGroup(1, 2 * MB, 0.050, 0.050)]}
    fit = fit_drag(groups, {"a": MS})
    assert fit.drag == 0.0 and str(MIN_SHARE_SPREAD) in fit.reason


def test_a_drag_column_that_follows_the_bytes_is_not_fitted() -> None:
    # the same bytes and the same time beside the compute in both groups (their shares differ through the
    # start-ups): the drag's column repeats the bytes' and the fit cannot split them
    groups = {"a": [DragGroup(1, MB, 0.0135, 0.005), DragGroup(100, MB, 0.1125, 0.005)]}
    fit = fit_drag(groups, {"a": MS})
    assert fit.drag == 0.0 and "do not determine" in fit.reason


def test_no_group_no_fit() -> None:
    assert fit_drag({"a": []}, {"a": MS}) == fit_drag({}, {}) == DragFit(0.0, "no busy group")
