"""What ``torch.save(model)`` makes of the hooks deft puts on the user's module and parameters.

torch's "save the entire model" (``torch.save(model, PATH)``: the module pickled whole, hooks and all)
works on torch DDP's module, which carries no Python hook of torch DDP's. deft's hooks (the forward
pre- and post-hooks, the gradient capture, the state_dict pre-hook) are registered on the user's module
and parameters, so they are pickled with them. Each is a ``functools.partial`` of a module-level
function and a :class:`DeadOnSave` reference to deft's object: it pickles, and it loads dead, so the
loaded module's hooks do nothing and it runs as a plain module (wrap it again to train it with deft).
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

T = TypeVar("T")


class DeadOnSave(Generic[T]):
    """A weak reference (a dropped wrapper's hooks call nothing) that pickles as a dead one."""

    __slots__ = ("_ref",)

    def __init__(self, obj: T | None = None) -> None:
        self._ref = None if obj is None else weakref.ref(obj)

    def __call__(self) -> T | None:
        return None if self._ref is None else self._ref()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (DeadOnSave, ())
