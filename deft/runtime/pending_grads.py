"""Gradients that are futures: what ``p.grad`` holds between ``backward()`` and ``optimizer.step()``.

A lag-free plan lets the all-reduce of some buckets run on after the backward, into the next forward
(``Update.deferred``, the sends of the next forward stage): their parameters are updated just before
their first use, so the communication overlaps the step, the data loading and the forward. torch DDP
shows the whole averaged gradient in ``p.grad`` after ``backward()``, and a loop may look at it there:
GradScaler's unscale and inf check (inside ``scaler.step``), ``clip_grad_norm_``, logging a norm.

So a deferred parameter's ``p.grad`` is a :class:`PendingGrad`: a tensor subclass with the gradient's
shape, dtype and device that holds no data until something touches it. Any operation on it (every
ATen op reaches ``__torch_dispatch__``, the in-place ones GradScaler and clipping use included, and
``.data``; ``.tolist()``, ``.numpy()``, ``copy.deepcopy`` and pickling read the value too) first
waits for the parameter's bucket and takes its averaged gradient (:meth:`Executor.finish` for that
parameter), then runs on that value. A touched gradient is applied by the user's step like any other,
with whatever the loop did to it (``p.grad.data = x`` included: ``x`` is applied); one the loop set to
None is skipped by the step and dropped from the next forward, as torch DDP's step skips it; an
untouched one is taken out of ``p.grad`` right before the optimizer reads it (:func:`settle_for_step`)
and applied in the next forward. So:

* a loop that never looks keeps the whole overlap;
* a loop that looks gets torch DDP's values and maths, and pays the wait for what it looked at;
* nothing the loop does can split one parameter's update between two steps or apply it twice.

A *placeholder* (:meth:`PendingGrad.zeros`) stands in ``p.grad`` at a step where no update is due (a
merged schedule's inner iterations): zeros for code that reads it (GradScaler needs some gradient to
inf-check), taken out before the optimizer steps, so the step changes nothing.

After the step, as torch DDP leaves the averaged gradient in ``p.grad`` until ``zero_grad()``, each
one taken out comes back as an *after-step* future (:meth:`PendingGrad.after_step`): a read waits for
the bucket without taking the update from the next forward, and zeroing it (``zero_grad(set_to_none=
False)``) waits for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map


class PendingGrad(torch.Tensor):
    """A parameter's averaged gradient that is resolved on first touch (module docstring)."""

    _resolve: Callable[[], torch.Tensor]
    _value: torch.Tensor | None
    placeholder: bool
    after: bool  # an after-step future (module docstring)

    @staticmethod
    def __new__(cls, like: torch.Tensor, resolve: Callable[[], torch.Tensor], placeholder: bool = False
                ) -> PendingGrad:
        r = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                requires_grad=False)
        r._resolve, r._value, r.placeholder, r.after = resolve, None, placeholder, False
        return r

    def __init__(self, like: torch.Tensor, resolve: Callable[[], torch.Tensor], placeholder: bool = False) -> None:
        super().__init__()

    @classmethod
    def zeros(cls, like: torch.Tensor) -> PendingGrad:
        """A placeholder: zeros to whoever reads it; never applied."""
        return cls(like, lambda: torch.zeros(like.shape, dtype=like.dtype, device=like.device), placeholder=True)

    @classmethod
    def after_step(cls, like: torch.Tensor, read: Callable[[], torch.Tensor]) -> PendingGrad:
        """What ``p.grad`` holds after the step where the update is still deferred: ``read`` gives its
        value without taking it from the executor (module docstring)."""
        r = cls(like, read)
        r.after = True
        return r

    @property
    def resolved(self) -> bool:
        return self._value is not None

    def value(self) -> torch.Tensor:
        """The averaged gradient (waits for its bucket the first time)."""
        if self._value is None:
            self._value = self._resolve()
        return self._value

    # Python-level reads that bypass ATen, which torch refuses for a tensor subclass: the value's own.
    def tolist(self) -> Any:
        return self.value().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.value().numpy(force=force)

    # ``p.grad.data = x`` replaces the gradient the step applies (torch's own setter would change only
    # the wrapper, whose value the step reads): the gradient becomes the loop's, ``x``.
    @property
    def data(self) -> torch.Tensor:
        return self.value()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        self.value()  # taken from the executor first: nothing of it is left deferred
        self._value = new

    def __deepcopy__(self, memo: dict[int, object]) -> torch.Tensor:
        return self.value().clone()

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save / pickle: the plain value
        return self.value().__reduce_ex__(protocol)

    # torch declares the base as a plain function; subclasses define a classmethod, as torch's docs do.
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: object,  # type: ignore[override]
                           args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None) -> object:
        if func in _ZEROING and _zeroed_after_step(args[0]):
            return args[0]

        def unwrap(x: object) -> object:
            return x.value() if isinstance(x, PendingGrad) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


#: What ``zero_grad(set_to_none=False)`` runs on the gradients.
_ZEROING = (torch.ops.aten.zero_.default, torch.ops.aten._foreach_zero_.default)


def _zeroed_after_step(target: object) -> bool:
    """Zero the after-step futures among ``target`` (a tensor or a list) without waiting for them, and
    the other tensors of a list as usual; False (nothing done) when an unresolved pre-step one is
    among them: that one is resolved and zeroed as any operation does."""
    items = list(target) if isinstance(target, (list, tuple)) else [target]
    if any(isinstance(t, PendingGrad) and not t.after and not t.resolved for t in items):
        return False
    for t in items:
        if isinstance(t, PendingGrad) and not t.resolved:
            t._value = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        elif isinstance(t, PendingGrad):
            t.value().zero_()
        else:
            t.zero_()  # type: ignore[union-attr]
    return True


def settle_for_step(params: Iterable[torch.Tensor]) -> None:
    """Right before the optimizer reads ``p.grad``: a touched gradient becomes its plain value (applied
    by this step); an untouched one and a placeholder leave ``p.grad`` (applied in the next forward,
    or never; the executor still holds it as deferred)."""
    for p in params:
        g = p.grad
        if not isinstance(g, PendingGrad):
            continue
        if g.resolved and not g.placeholder:
            p.grad = g.value()
        else:
            p.grad = None

