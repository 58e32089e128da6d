"""Where each parameter is first used in the forward: the module before whose forward its deferred
update must be applied.

A deferred update (a lag-free plan's bucket still in flight after the step) is applied just before
the parameter's first use in the next forward. Module ownership is not first use: a parent may call
``F.linear(h, self.head.weight, self.head.bias)`` without ever calling ``self.head``, and a tied
weight (GPT-2's ``lm_head`` is ``wte``) is used first by whichever module runs first. Applied after
its first use, the update would change a tensor autograd saved (the in-place error in backward) and
the forward would have used the old value.

So deft watches one real forward (:class:`FirstUseRecorder`, during warm-up): a
``TorchFunctionMode`` sees every torch function called with a parameter, and global module hooks keep
the stack of modules whose forward is running; a parameter's first use is attributed to the innermost
running module. Parameters the watched forward did not use keep their owning module (a branch taken
later runs its module's forward first). Forwards later differ only in which branches they take, which
the owners cover.

The buffers' reads are recorded the same way (``buffer_readers``: every module reading each, first
reader first): the broadcast of rank 0's buffers is waited for just before the first of them, or the
reads caught up after the forward where only a batch norm's own update reads them
(:mod:`deft.runtime.buffer_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class _UseMode(TorchFunctionMode):
    def __init__(self, on_use: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._on_use = on_use

    def __torch_function__(self, func: object, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        for a in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(a, torch.Tensor):
                self._on_use(a)
        assert callable(func)
        return func(*args, **(kwargs or {}))


class FirstUseRecorder:
    """Records, over one forward, the innermost running module at each parameter's first use, and
    every module reading each of ``buffers``, in the order of their first reads."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor] | None = None) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._buffer_index = {id(b): i for i, b in enumerate(buffers or [])}
        self.first: dict[int, nn.Module] = {}  # parameter index -> module
        self.buffer_readers: dict[int, list[nn.Module]] = {}  # buffer index -> modules, first reader first
        self._stack: list[nn.Module] = []

    def _use(self, t: torch.Tensor) -> None:
        if not self._stack:
            return
        i = self._index.get(id(t))
        if i is not None:
            self.first.setdefault(i, self._stack[-1])
            return
        j = self._buffer_index.get(id(t))
        if j is not None:
            readers = self.buffer_readers.setdefault(j, [])
            if not any(m is self._stack[-1] for m in readers):
                readers.append(self._stack[-1])

    def _enter(self, m: nn.Module, args: object) -> None:
        self._stack.append(m)

    def _leave(self, m: nn.Module, args: object, out: object) -> None:
        if self._stack and self._stack[-1] is m:
            self._stack.pop()

    @contextmanager
    def watching(self, root: nn.Module) -> Iterator[None]:
        """Watch the forward of ``root`` run inside this context."""
        pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = nn.modules.module.register_module_forward_hook(self._leave)
        self._stack = [root]  # the root's own body (outside any child) counts as the root
        try:
            with _UseMode(self._use):
                yield
        finally:
            pre.remove()
            post.remove()
            self._stack = []


def first_use_modules(module: nn.Module, params: list[torch.Tensor], recorded: Mapping[int, nn.Module],
                      hooked: Callable[[nn.Module], nn.Module]) -> dict[int, list[int]]:
    """``id(module) -> parameter indices`` whose deferred updates its forward pre-hook applies: the
    recorded first use, else the module owning the parameter; ``hooked`` gives the module whose
    pre-hook runs first before that one's forward (``deft.runtime.eager.ForwardHooks.hooked``)."""
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[int, list[int]] = {}
    owners: dict[int, nn.Module] = {}
    for owner in module.modules():
        for p in owner.parameters(recurse=False):
            if id(p) in index:
                owners.setdefault(index[id(p)], owner)
    for i in range(len(params)):
        m = recorded[i] if i in recorded else owners.get(i)
        if m is not None:
            out.setdefault(id(hooked(m)), []).append(i)
    return out
