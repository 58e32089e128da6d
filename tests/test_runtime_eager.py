"""deft's forward hooks and bookkeeping under Dynamo (``deft.runtime.eager``), in one process."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from deft.runtime.eager import ForwardHooks, forget_compiled, outside_graphs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_every_module_with_a_parameter_under_it_is_heard_in_forward_order() -> None:
    net = Net()
    hooks = ForwardHooks(net)
    began: list[str] = []
    ended: list[str] = []
    names = {id(m): n or "root" for n, m in net.named_modules()}
    hooks.listen(pre=lambda m: began.append(names[id(m)]), post=lambda m: ended.append(names[id(m)]))
    net(torch.randn(3, 4))
    assert began == ["root", "body", "body.0", "body.2"]  # the Tanh has no parameter: no hook
    assert ended == ["body.0", "body.2", "body", "root"]


def test_a_module_without_parameters_is_placed_at_its_nearest_hooked_ancestor() -> None:
    net = Net()
    hooks = ForwardHooks(net)
    assert hooks.hooked(net.body[1]) is net.body
    assert hooks.hooked(net.body[0]) is net.body[0]


def test_a_removed_listener_and_a_closed_or_dropped_hook_set_are_not_called() -> None:
    net = Net()
    hooks = ForwardHooks(net)
    calls: list[nn.Module] = []
    handle = hooks.listen(pre=calls.append)
    handle.remove()
    net(torch.randn(1, 4))
    assert calls == []
    hooks.listen(pre=calls.append)
    del hooks
    gc.collect()
    net(torch.randn(1, 4))  # the module's hooks hold the set weakly: a dropped wrapper's listeners stay quiet
    assert calls == []
    fresh = Net()
    closed = ForwardHooks(fresh)
    closed.close()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in fresh.modules())


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def tick(self) -> None:
        """Per-iteration state, as deft's bookkeeping keeps it (nothing returned into the graph)."""
        self.n += 1


def _compiled_step(tick: object) -> object:
    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        tick()  # type: ignore[operator]
        return x * 2
    return step


def test_bookkeeping_outside_graphs_does_not_recompile_as_its_state_changes() -> None:
    c = _Counter()
    step = _compiled_step(outside_graphs(c.tick))
    step(torch.ones(2))
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(3):
            step(torch.ones(2))
    assert c.n == 4


def test_the_same_bookkeeping_traced_recompiles_as_its_state_changes() -> None:
    """The check above can fail: traced, the counter's value is a guard of the graph."""
    torch._dynamo.reset()
    c = _Counter()
    step = _compiled_step(c.tick)
    step(torch.ones(2))
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="recompile"):
        step(torch.ones(2))


class Broken(nn.Module):
    """A forward Dynamo resumes after a graph break of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)


def _returns_as_is(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as HuggingFace puts on its models' ``forward`` (``functools.wraps``)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


class Decorated(Broken):
    """A graph break in the decorated function: Dynamo compiles it as a frame of its own."""

    @_returns_as_is
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


def _heard_after_an_earlier_compile(cls: type[nn.Module], forget: bool) -> tuple[list[str], list[str]]:
    """An instance of ``cls`` compiled and run before a second one gets deft's hooks; the second's
    modules heard under ``torch.compile``, and what :func:`forget_compiled` dropped."""
    torch._dynamo.reset()
    torch.compile(cls(), backend="eager")(torch.randn(2, 4))
    net = cls()
    hooks = ForwardHooks(net)
    dropped = forget_compiled(net) if forget else []
    names = {id(m): n or "root" for n, m in net.named_modules()}
    heard: list[str] = []
    hooks.listen(pre=lambda m: heard.append(names[id(m)]))
    torch.compile(net, backend="eager")(torch.randn(2, 4))
    return heard, dropped


@pytest.mark.parametrize("cls", [Net, Broken, Decorated])
def test_code_compiled_for_the_class_before_the_hooks_is_dropped_and_the_hooks_run(cls: type[nn.Module]) -> None:
    heard, dropped = _heard_after_an_earlier_compile(cls, forget=True)
    children = ["body", "body.0", "body.2"] if cls is Net else ["first", "second"]
    assert heard == ["root", *children]
    assert dropped == [cls.forward.__qualname__]


@pytest.mark.parametrize("cls", [Net, Broken, Decorated])
def test_without_dropping_it_the_earlier_code_runs_past_the_hooks(cls: type[nn.Module]) -> None:
    """The check above can fail: Dynamo reuses the class's code, compiled while no module had a hook."""
    heard, _ = _heard_after_an_earlier_compile(cls, forget=False)
    assert heard == ["root"]  # only the root's hook, which runs outside its compiled forward


def test_nothing_compiled_for_the_class_nothing_dropped() -> None:
    torch._dynamo.reset()
    assert forget_compiled(Net()) == []


def test_a_torch_without_dynamos_cache_helpers_is_said_and_nothing_dropped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from torch._dynamo import eval_frame

    monkeypatch.delattr(eval_frame, "remove_from_cache")
    with caplog.at_level("WARNING", logger="deft.runtime"):
        assert forget_compiled(Net()) == []
    assert "torch._dynamo.reset()" in caplog.text
