"""The watch over the parameters between the step and the next forward (deft.runtime.param_watch)."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from deft.runtime.param_watch import ParamWatch


def _stack_depth() -> int:
    return int(torch._C._len_torch_function_stack())


class _Seen:
    """``on_touch``: what was used, and the watched parameter's value at that moment."""

    def __init__(self, p: torch.Tensor) -> None:
        self.p = p
        self.uses: list[str] = []
        self.values: list[list[float]] = []

    def __call__(self, what: str) -> None:
        with torch.no_grad():
            self.values.append(self.p.detach().clone().tolist())  # inert now: no second call
        self.uses.append(what)


def test_the_first_use_is_announced_once_before_it_runs() -> None:
    p = nn.Parameter(torch.ones(3))
    seen = _Seen(p)
    watch = ParamWatch(seen)
    watch.arm([("head.weight", p)])
    with torch.no_grad():
        p.mul_(2.0)
        p.add_(1.0)
    watch.disarm()
    assert seen.uses == ["Tensor.mul_ on head.weight"]
    assert seen.values == [[1.0, 1.0, 1.0]]  # before the first use ran
    assert p.tolist() == [3.0, 3.0, 3.0]


def test_metadata_and_gradients_are_not_uses() -> None:
    """What zero_grad() and the optimizer's bookkeeping touch every iteration does not count."""
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = _Seen(model.weight)
    watch = ParamWatch(seen)
    watch.arm([("weight", model.weight), ("bias", model.bias)])
    _ = (model.weight.shape, model.weight.dtype, model.weight.device, model.weight.requires_grad,
         model.weight.numel(), model.weight.size(0), model.weight.grad)
    opt.zero_grad(set_to_none=False)
    opt.zero_grad()
    torch.optim.lr_scheduler.StepLR(opt, 1)
    torch.randn(5).sum()  # the next batch
    assert watch.armed
    watch.disarm()
    assert seen.uses == []


def test_reading_through_data_detach_or_a_list_is_a_use() -> None:
    for use in (lambda p: p.data, lambda p: p.detach(), lambda p: torch._foreach_mul([torch.ones(3), p], 0.5),
                lambda p: torch.stack([p, p]), lambda p: p.norm().item()):
        p = nn.Parameter(torch.ones(3))
        seen = _Seen(p)
        watch = ParamWatch(seen)
        watch.arm([("w", p)])
        use(p)
        watch.disarm()
        assert len(seen.uses) == 1, seen.uses


def test_other_tensors_are_not_uses() -> None:
    p, other = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    seen = _Seen(p)
    watch = ParamWatch(seen)
    watch.arm([("w", p)])
    with torch.no_grad():
        other.mul_(3.0)
    watch.disarm()
    assert seen.uses == []


class _UserMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_around_the_loop_leaves_with_its_own_exit() -> None:
    """A mode entered before the watch is armed and left before it is disarmed (a ``with`` around a
    whole loop ending after a step) pops itself, and the watch still sees the uses after it."""
    p = nn.Parameter(torch.ones(3))
    seen = _Seen(p)
    watch = ParamWatch(seen)
    user = _UserMode()
    with user:
        watch.arm([("w", p)])
        torch.ones(2).sum()
    assert _stack_depth() == 1  # the watch, not the user's mode
    p.detach()
    assert len(seen.uses) == 1
    watch.disarm()
    assert _stack_depth() == 0
    calls = user.calls
    torch.ones(2).sum()
    assert user.calls == calls  # the user's mode is gone with its with block


def test_a_mode_entered_after_arming_sees_the_calls_first_and_stays() -> None:
    p = nn.Parameter(torch.ones(3))
    seen = _Seen(p)
    watch = ParamWatch(seen)
    watch.arm([("w", p)])
    user = _UserMode()
    with user:
        p.detach()
        watch.disarm()  # the next forward begins inside the user's mode
        assert _stack_depth() == 1
        torch.ones(2).sum()
    assert user.calls >= 2
    assert len(seen.uses) == 1
    assert _stack_depth() == 0


def test_disarming_from_the_announcement_leaves_the_stack_once_it_returns() -> None:
    """``on_touch`` applies the updates and disarms the watch while torch has taken it off the stack to
    run it; the watch leaves when next disarmed, and arms again without being stacked twice."""
    p = nn.Parameter(torch.ones(3))
    watch: ParamWatch

    def on_touch(what: str) -> None:
        watch.disarm()

    watch = ParamWatch(on_touch)
    watch.arm([("w", p)])
    p.detach()
    assert not watch.armed
    watch.arm([("w", p)])
    assert _stack_depth() == 1
    watch.disarm()
    assert _stack_depth() == 0


def test_arming_with_nothing_to_watch_stays_off_the_stack() -> None:
    watch = ParamWatch(lambda what: None)
    watch.arm([])
    assert _stack_depth() == 0 and not watch.armed
