"""deft's bookkeeping outside Dynamo's graphs, for a wrapper compiled after wrapping.

torch advises compiling the DDP-wrapped model (``torch.compile(DistributedDataParallel(model))``), and
a line copied from torch DDP does so with deft; so does Accelerate's ``dynamo_backend``. Dynamo then
traces the wrapper's ``forward`` and every module hook it meets. deft's part of the forward reads and
changes per-iteration state (the iteration, the buckets still in flight, clocks, the phase of the run):
traced, each such value would become a guard of the graph, every iteration would fail the last one's
guards and recompile, until Dynamo's recompile limit sent the frame back to eager for the rest of the run.

So every entry point of deft's into the forward (the wrapper's bookkeeping before and after the
module, the buffers' broadcast, the module hooks) is marked :func:`outside_graphs`: Dynamo breaks the
graph there and calls it eagerly, and guards nothing inside it. The module's own layers between two
hooks are compiled.

And the module hooks never change (:class:`ForwardHooks`). Dynamo does not guard a module's hooks
(``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default): code compiled while a module had
no hook never calls one added later. deft's needs change over a run (the warm-up timer's, the
deferred updates' as each schedule starts): were its hooks added as they are needed, a forward compiled
before a schedule's pre-hooks existed (under Accelerate's ``dynamo_backend`` with accumulation, the
first iteration's second micro-batch) would never apply a deferred update before its module; it would
be applied at the forward's end, after its parameter's use was saved for the backward, and the backward
would fail in place. So one pre-hook and one post-hook per module are installed with the wrapper and
kept until it closes, and deft's collaborators listen to them for as long as they need. The pre-hook
goes ahead of the hooks the module already had: one of those (``weight_norm``'s, computing the weight
from its parameters) would otherwise read a parameter before its deferred update, and the update would
then change a tensor autograd saved.

For the same reason, code Dynamo compiled for the model's classes *before* the wrapper was built
(another instance compiled, torch DDP's run before deft's in one process) would be reused for the
wrapped model without deft's hooks: a deferred update would not be applied before its module, and the
backward would fail in place many iterations in. So the wrapper drops that code when it installs the
hooks (:func:`forget_compiled`); the model's classes compile again, with the hooks, the next time Dynamo
meets them.

Note: a graph break at each hooked module is the price; torch DDP under Dynamo splits its graph at
bucket boundaries for a similar reason (``DDPOptimizer``). A module compiled *before* wrapping gets its
updates whole at the step (``deft.runtime.compat.for_compiled``): its compiled code may predate the
hooks.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deft.runtime.saved_hooks import DeadOnSave

log = logging.getLogger("deft.runtime")

F = TypeVar("F", bound=Callable[..., Any])


def outside_graphs(fn: F) -> F:
    """``fn``, called eagerly between graphs when Dynamo traces a caller (module docstring)."""
    return cast(F, torch.compiler.disable(fn, reason="deft's per-iteration bookkeeping runs eagerly"))


#: A listener of :class:`ForwardHooks`: called with the module whose forward begins (or ends).
Listener = Callable[[nn.Module], None]


class ForwardHooks:
    """A forward pre-hook and a forward hook on every module with a parameter in its subtree, from the
    wrapper's construction to its close; they call whoever listens now (:meth:`listen`; module
    docstring). A module without a parameter under it gets none: a parameter it uses first is
    attributed to its nearest hooked ancestor (:meth:`hooked`)."""

    def __init__(self, root: nn.Module) -> None:
        # OrderedDict: a RemovableHandle keeps a weak reference to its dicts (a dict takes none)
        self._pre: OrderedDict[int, Listener] = OrderedDict()
        self._post: OrderedDict[int, Listener] = OrderedDict()
        self._hooked = {id(m) for m in root.modules() if next(m.parameters(), None) is not None}
        self._parent = {id(child): m for m in root.modules() for child in m.children()}
        # picklable, and dead once loaded: torch.save(model) saves the module hooks and all (saved_hooks)
        pre, post = functools.partial(_pre_hook, DeadOnSave(self)), functools.partial(_post_hook, DeadOnSave(self))
        # the pre-hook ahead of any the module had: a hook of the user's sees its deferred update applied
        # and rank 0's buffers, as under torch DDP, where both are in place before the module is called
        self._handles = [h for m in root.modules() if id(m) in self._hooked
                         for h in (m.register_forward_pre_hook(pre, prepend=True), m.register_forward_hook(post))]
        self._ids = {h.id for h in self._handles}

    def listen(self, pre: Listener | None = None, post: Listener | None = None) -> RemovableHandle:
        """Call ``pre`` (``post``) as each hooked module's forward begins (ends), until the handle's
        ``remove()``."""
        handle = RemovableHandle(self._pre, extra_dict=self._post)
        if pre is not None:
            self._pre[handle.id] = pre
        if post is not None:
            self._post[handle.id] = post
        return handle

    def hooked(self, m: nn.Module) -> nn.Module:
        """``m``, or its nearest ancestor with hooks: a pre-hook there runs before ``m``'s forward."""
        while id(m) not in self._hooked and id(m) in self._parent:
            m = self._parent[id(m)]
        return m

    def only_ours(self, m: nn.Module) -> bool:
        """No forward hook on ``m`` but this set's, and no global one: nothing but ``m``'s forward sees its
        state between that forward's start and end."""
        mod = nn.modules.module
        return (all(k in self._ids for k in m._forward_pre_hooks) and all(k in self._ids for k in m._forward_hooks)
                and not mod._global_forward_pre_hooks and not mod._global_forward_hooks)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pre.clear()
        self._post.clear()

    def begins(self, m: nn.Module) -> None:
        """``m``'s forward begins: every pre listener, in the order they listen."""
        for fn in tuple(self._pre.values()):
            fn(m)

    def ends(self, m: nn.Module) -> None:
        """``m``'s forward ended: every post listener."""
        for fn in tuple(self._post.values()):
            fn(m)


def forget_compiled(root: nn.Module) -> list[str]:
    """Drop the code Dynamo compiled for the ``forward`` of ``root``'s module classes (and the functions
    their decorators wrap), and for the frames it resumes them in after a graph break; the names of the
    forwards that had some.

    Note: Dynamo caches compiled code on the code object of the function it compiled, which is the
    class's ``forward``, shared by every instance; its guards check the instance's tensors but not
    its modules' hooks (module docstring), so nothing else would tell the old code from the new. Code
    of other classes is left as it is; an instance of these classes elsewhere compiles again once.
    """
    from torch._dynamo import eval_frame, resume_execution

    try:  # Dynamo's own helpers, not a public API: another torch may lack them
        resumes = resume_execution.ContinueExecutionCache.cache
        entries, remove = eval_frame._debug_get_cache_entry_list, eval_frame.remove_from_cache
    except AttributeError as e:
        log.warning("deft: cannot drop code torch.compile made for the model's classes before deft's hooks "
                    "(%s); if this process compiled them before building the wrapper, call "
                    "torch._dynamo.reset() first", e)
        return []
    dropped: list[str] = []
    for fn in dict.fromkeys(type(m).forward for m in root.modules()):  # each class's once, in order
        codes = [c for f in _unwrapped(fn) for c in _with_resumes(f.__code__, resumes)]
        if any(entries(c) for c in codes):
            for c in codes:
                remove(c)
            dropped.append(fn.__qualname__)
    return dropped


def _unwrapped(fn: Any) -> list[Any]:
    """``fn`` and the functions its decorators wrap (``__wrapped__``, as HuggingFace's ``forward``
    decorators set it): Dynamo may have compiled any of them, the outermost's code shared by every
    function that decorator wraps."""
    out: list[Any] = []
    while hasattr(fn, "__code__") and fn not in out:
        out.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return out


def _with_resumes(code: Any, resumes: Any) -> list[Any]:
    """``code`` and every frame Dynamo generated to resume it, or them, after a graph break."""
    out, todo = [], [code]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(resumes.get(c, {}).values())
    return out


@outside_graphs
def _pre_hook(me: DeadOnSave[ForwardHooks], m: nn.Module, args: object) -> None:
    """Through a weak reference, so a dropped wrapper's listeners are not called."""
    d = me()
    if d is not None:
        d.begins(m)


@outside_graphs
def _post_hook(me: DeadOnSave[ForwardHooks], m: nn.Module, args: object, out: object) -> None:
    d = me()
    if d is not None:
        d.ends(m)
