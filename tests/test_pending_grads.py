"""Gradients that are futures (deft.runtime.pending_grads), one process, no communication.

What a loop may do with ``p.grad`` between ``backward()`` and ``step()``: every read and in-place change
resolves the future once and acts on its value; ``settle_for_step`` then leaves a touched gradient (as its
plain value, with the loop's changes) for the optimizer, and takes an untouched one and a placeholder
out of ``p.grad``.
"""

from __future__ import annotations

import copy
import io
import pickle

import torch

from deft.runtime.pending_grads import PendingGrad, settle_for_step


def _param_with_pending(value: torch.Tensor, after_step: bool = False) -> tuple[torch.nn.Parameter, list[int]]:
    """A parameter whose ``p.grad`` is a future of ``value`` (``after_step``: an after-step one); the
    list its resolver appends to."""
    calls: list[int] = []
    p = torch.nn.Parameter(torch.zeros_like(value))

    def resolve() -> torch.Tensor:
        calls.append(1)
        return value.clone()
    p.grad = PendingGrad.after_step(p, resolve) if after_step else PendingGrad(p, resolve)
    return p, calls


def test_reads_and_in_place_changes_act_on_the_value_resolved_once() -> None:
    p, calls = _param_with_pending(torch.tensor([3.0, 4.0]))
    assert calls == []  # nothing touched yet: nothing waited for
    assert float(p.grad.norm()) == 5.0
    p.grad.mul_(0.5)  # in place, as clip_grad_norm_ and GradScaler's unscale do
    p.grad.data.add_(1.0)  # old-style code through .data
    assert p.grad.tolist() == [2.5, 3.0] and p.grad.numpy().tolist() == [2.5, 3.0]
    assert torch.equal(copy.deepcopy(p.grad), torch.tensor([2.5, 3.0]))
    buf = io.BytesIO()
    torch.save(p.grad, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True), torch.tensor([2.5, 3.0]))
    assert torch.equal(pickle.loads(pickle.dumps(p.grad)), torch.tensor([2.5, 3.0]))
    assert calls == [1]


def test_clip_and_grad_scaler_see_the_values() -> None:
    p, _ = _param_with_pending(torch.tensor([30.0, 40.0]))
    norm = torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert abs(float(norm) - 50.0) < 1e-5
    found_inf = torch.zeros(1)
    q, _ = _param_with_pending(torch.tensor([float("inf"), 1.0]))
    torch._amp_foreach_non_finite_check_and_unscale_([q.grad], found_inf, torch.tensor(0.5))
    assert float(found_inf) == 1.0
    settle_for_step([p])
    assert type(p.grad) is torch.Tensor and torch.allclose(p.grad, torch.tensor([0.6, 0.8]))


def test_settle_for_step_keeps_touched_and_drops_untouched_and_placeholders() -> None:
    touched, _ = _param_with_pending(torch.tensor([1.0, 2.0]))
    untouched, calls = _param_with_pending(torch.tensor([5.0, 6.0]))
    placeholder = torch.nn.Parameter(torch.zeros(2))
    placeholder.grad = PendingGrad.zeros(placeholder)
    plain = torch.nn.Parameter(torch.zeros(2))
    plain.grad = torch.tensor([7.0, 8.0])
    touched.grad.add_(1.0)
    assert float(placeholder.grad.sum()) == 0.0  # reads as zeros (a GradScaler finds something to check)
    settle_for_step([touched, untouched, placeholder, plain])
    assert torch.equal(touched.grad, torch.tensor([2.0, 3.0]))  # applied by this step, with the loop's change
    assert untouched.grad is None and calls == []  # applied in the next forward, never waited for here
    assert placeholder.grad is None  # never applied
    assert torch.equal(plain.grad, torch.tensor([7.0, 8.0]))


def test_an_after_step_gradient_zeroed_waits_for_nothing_and_reads_zeros() -> None:
    """``zero_grad(set_to_none=False)`` right after the step: no wait for the bucket, zeros after."""
    p, calls = _param_with_pending(torch.tensor([1.0, -2.0]), after_step=True)
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    torch.optim.SGD([p, q], lr=0.1).zero_grad(set_to_none=False)
    assert calls == []
    assert p.grad is not None and q.grad is not None
    assert p.grad.tolist() == [0.0, 0.0] and q.grad.tolist() == [0.0, 0.0]


def test_an_after_step_gradient_read_gives_its_value_and_a_pending_one_zeroed_is_resolved() -> None:
    p, calls = _param_with_pending(torch.tensor([3.0, 4.0]), after_step=True)
    assert p.grad is not None and float(p.grad.norm()) == 5.0 and calls == [1]
    before, waited = _param_with_pending(torch.tensor([1.0]))  # before the step: zeroing it is touching it
    assert before.grad is not None
    before.grad.zero_()
    assert waited == [1] and before.grad.tolist() == [0.0]
