"""The loop's use of a parameter between ``optimizer.step()`` and the next forward.

A lag-free plan leaves part of an update finishing in the next forward (:mod:`deft.runtime.updates`):
each parameter whose bucket is still in flight at the step gets its update just before its first use
in the forward. Code between the step and that forward may use those parameters: an EMA of the
weights (``AveragedModel.update_parameters``), weight clipping (``p.data.clamp_``), a logged norm, a
penalty computed before the forward, a rollback to weights kept in memory, a copy taken as a
checkpoint. Under torch DDP it sees the stepped values, and so it must here.

:class:`ParamWatch` is a ``TorchFunctionMode`` armed after the user's step while updates are left
finishing. It sees every torch function this thread calls until the next forward of the wrapper; the
first that is given one of the watched tensors (the parameters with a deferred update and their
optimizer state, or a list holding one) calls ``on_touch`` before it runs, which applies those
updates, and the watch goes inert. A loop that uses no parameter there keeps the overlap; one that
does gets torch DDP's values and loses the overlap of that iteration only.

Not a use: reading metadata (shape, dtype, device, ...) and ``p.grad`` (its values are futures of
their own, :mod:`deft.runtime.pending_grads`), which ``zero_grad()`` and the optimizer's bookkeeping
touch every iteration.

Note: the watch goes in at the *bottom* of the thread's function-mode stack, and leaves from wherever
it is. A mode the loop entered before the step and leaves before the next forward (a ``with`` around
a whole loop, ending after its last step) pops itself, not the watch, as it would without deft; a
mode entered after the step sits above the watch and sees the calls first. What the watch cannot
see: another thread's calls (modes are per thread), and changes made without a torch function
(``optimizer.state`` replaced as a dict; its ``load_state_dict`` is hooked instead,
:mod:`deft.runtime.optimizer_hooks`). Its price is a Python call per torch function in the window,
as for any function mode; the loop's next batch is the most of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

#: Tensor attributes whose reading (``__get__``) is not a use of the values.
METADATA_ATTRIBUTES = frozenset({
    "grad", "_grad", "shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim", "names",
    "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "grad_fn",
    "_backward_hooks", "_post_accumulate_grad_hooks", "_version", "output_nr", "itemsize", "nbytes"})
#: Tensor attributes whose setting (``__set__``) is not a use of the values.
SETTABLE_ATTRIBUTES = frozenset({"grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks"})
#: Tensor methods that read no values.
METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "stride", "is_floating_point", "is_complex", "element_size",
    "data_ptr", "is_contiguous", "storage_offset", "get_device", "__hash__", "requires_grad_",
    "register_hook", "register_post_accumulate_grad_hook"})


def reads_values(func: object) -> bool:
    """Does calling ``func`` (as a torch function mode is given it) use a tensor's values?"""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__") and owner is not None:  # a tensor attribute
        attribute = getattr(owner, "__name__", "")
        return attribute not in (METADATA_ATTRIBUTES if name == "__get__" else SETTABLE_ATTRIBUTES)
    return name not in METADATA_METHODS


class ParamWatch(TorchFunctionMode):
    """Calls ``on_touch(what)`` once, before the first torch function given a watched tensor, between
    :meth:`arm` and :meth:`disarm` (module docstring). ``what`` names the function and the tensor."""

    def __init__(self, on_touch: Callable[[str], None]) -> None:
        super().__init__()
        self._on_touch = on_touch
        self._watched: dict[int, str] = {}  # id(tensor) -> its name in messages
        self._stacked = False  # on this thread's function-mode stack
        self._inside = False  # in __torch_function__: torch has taken the mode off the stack meanwhile

    @property
    def armed(self) -> bool:
        return bool(self._watched)

    def arm(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Watch ``(name, tensor)`` pairs in this thread until the first use or :meth:`disarm`."""
        self._watched = {id(t): name for name, t in tensors}
        if self._watched and not self._stacked:
            _insert_at_bottom(self)
            self._stacked = True

    def disarm(self) -> None:
        """Stop watching and leave the mode stack (from inside a call it handles: once it returns)."""
        self._watched = {}
        if self._stacked and not self._inside:
            _remove(self)
            self._stacked = False

    def __torch_function__(self, func: object, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        watched = self._watched
        if watched:  # the arguments first: most calls in the window (the next batch) take no parameter
            hit = _first_watched(watched, args, kwargs)
            if hit is not None and reads_values(func):
                self._watched = {}  # inert from here: on_touch's own optimizer step runs through this mode
                self._inside = True
                try:
                    self._on_touch(f"{_name(func)} on {hit}")
                finally:
                    self._inside = False
        assert callable(func)
        return func(*args, **kwargs) if kwargs else func(*args)


def _first_watched(watched: dict[int, str], args: tuple[object, ...],
                   kwargs: dict[str, object] | None) -> str | None:
    """The name of the first watched tensor among the arguments (one level into lists and tuples:
    the ``torch._foreach_*`` functions take lists of parameters)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, list | tuple):
            for x in a:
                if id(x) in watched:
                    return watched[id(x)]
        elif id(a) in watched:
            return watched[id(a)]
    return None


def _name(func: object) -> str:
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") in ("__get__", "__set__") and owner is not None:
        return f"Tensor.{getattr(owner, '__name__', owner)}"
    return str(getattr(func, "__qualname__", func)).replace("TensorBase.", "Tensor.")


def _insert_at_bottom(mode: TorchFunctionMode) -> None:
    above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(mode)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _remove(mode: TorchFunctionMode) -> None:
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if not any(m is mode for m in stack):
        return
    for _ in stack:
        torch._C._pop_torch_function_stack()
    for m in stack:
        if m is not mode:
            torch._C._push_on_torch_function_stack(m)
