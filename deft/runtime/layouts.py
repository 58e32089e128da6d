"""Which flat layout each schedule runs on: the warm-up's buckets, and the order a plan's buckets follow.

A layout (:class:`deft.runtime.buckets.FlatLayout`) lays the trainable parameters out in one order
and cuts that into buckets; every schedule runs on one. During warm-up it is torch DDP's: buckets of
whole parameters in gradient-ready order. A plan's buckets follow the observed ready order, or the
given profile's bucket order when that names exactly the module's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deft.profile import Profile, param_names
from deft.runtime.buckets import FlatLayout, ddp_like_bucket_numel

#: Warm-up buckets are no larger than torch DDP's first bucket (1 MB): they are also the profile's
#: buckets, and the planner needs per-layer resolution of compute and ready times.
PROFILE_BUCKET_CAP_MB = 1.0


def warmup_layout(order: list[int], names: list[str], params: list[torch.Tensor], bucket_cap_mb: float,
                  chained_hook: bool, first_bucket_cap_mb: float = 1.0, split_over: int = 1) -> FlatLayout:
    """torch DDP's buckets during warm-up: whole parameters in ready order, a large one cut.

    Their cap is :data:`PROFILE_BUCKET_CAP_MB`, except under a chained comm hook (PowerSGD, a user's
    hook: :attr:`deft.runtime.codecs.hooks.CommHook.chained`), where it is ``bucket_cap_mb`` as in torch
    DDP: such sends run one at a time over all links and each pays the hook's collectives and its
    per-call compute, so small buckets would make the warm-up and profile iterations slow and their
    per-bucket times too noisy to choose a bucket count (benchmarks/RESULTS.md, "Figures behind the
    runtime's constants"). The planner may still fuse these buckets; a smaller ``bucket_cap_mb`` gives
    it finer ones. Their first bucket is capped at ``first_bucket_cap_mb``, torch 2.13's rule (1 MB
    with the default cap, the cap itself when one is given), so that deft's synchronous schedule under
    such a hook is torch DDP's with the same arguments.

    ``split_over = L > 1`` (``L`` links, without a chained hook): a bucket larger than ``1 / (2 L)`` of
    the model's bytes is cut into equal pieces no larger than that, so that the links share the bytes
    evenly (:func:`balanced_links`, and the profile iterations' rotation) even where one parameter
    holds most of the model (an all-reduce of a piece is the piece of the all-reduce: torch DDP's
    sums). The profile measures the pieces (:meth:`~deft.runtime.buckets.FlatLayout.bucket_names`) and
    the planner fuses or cuts them again. Whole, one large weight (the digits CNN's fc) holds one link
    while the other idles, and each profile iteration takes that link's time for all the bytes
    (benchmarks/results/slow_links.md)."""
    if not chained_hook:
        cap = min(bucket_cap_mb, PROFILE_BUCKET_CAP_MB)
        numel = ddp_like_bucket_numel(order, params, cap)
        if split_over > 1:
            numel = _split_large(numel, order, params, split_over)
        return FlatLayout(order, names, params, numel, "<warm-up buckets>")
    return FlatLayout(order, names, params, ddp_like_bucket_numel(order, params, bucket_cap_mb, first_bucket_cap_mb),
                      "<warm-up buckets>")


def _split_large(bucket_numel: Sequence[int], order: Sequence[int], params: Sequence[torch.Tensor],
                 links: int) -> tuple[int, ...]:
    """``bucket_numel`` with every bucket over ``1 / (2 links)`` of the model's bytes cut into equal
    pieces of at most that (a bucket holds one dtype: its element size is its first parameter's)."""
    total = sum(params[i].numel() * params[i].element_size() for i in order)
    limit = max(1, total // (2 * links))
    bounds = []  # (first flat element, element size) of each parameter in order
    flat = 0
    for i in order:
        bounds.append((flat, params[i].element_size()))
        flat += params[i].numel()
    out: list[int] = []
    flat, j = 0, 0  # elements of the flat order before this bucket; its first parameter
    for n in bucket_numel:
        while j + 1 < len(bounds) and bounds[j + 1][0] <= flat:
            j += 1
        size = bounds[j][1]
        pieces = max(1, -(-(n * size) // limit))
        step = -(-n // pieces)
        out += [min(step, n - k) for k in range(0, n, step)]
        flat += n
    return tuple(out)


def balanced_links(nbytes: Sequence[int], links: Sequence[str]) -> tuple[str, ...]:
    """The warm-up's link of each bucket (in ready order): the link with the fewest bytes so far (ties:
    the first configured). Exact all-reduces on several links give torch DDP's sums; spreading the
    bytes shortens the first iterations where a single link is the bound."""
    load = dict.fromkeys(links, 0)
    out = []
    for n in nbytes:
        link = min(load, key=lambda k: load[k])
        load[link] += n
        out.append(link)
    return tuple(out)


def ready_order(seen: Sequence[int], n_params: int) -> list[int]:
    """The layout order from the first iteration's gradients: in the order they arrived, then the
    parameters that got none (reversed registration order, torch DDP's guess)."""
    got = set(seen)
    return list(seen) + [i for i in reversed(range(n_params)) if i not in got]


def plan_order(profile: Profile | None, profile_given: bool, names: list[str], observed: list[int] | None) -> list[int]:
    """The flat order of a plan's layout: the given profile's bucket order when it names exactly our
    parameters, each once (``module.`` prefixes ignored; a parameter cut into pieces, ``w[0:5]``,
    ``w[5:9]``, as a measured profile names them, counts once where its pieces are consecutive), else
    the observed ready order."""
    order = list(observed or reversed(range(len(names))))
    if profile is None or not profile_given:
        return order
    listed: list[str] = []
    for b in profile.buckets:
        for name in b.params:
            bases, ranged = param_names(name)
            for base in (n.removeprefix("module.") for n in bases):
                if not (ranged and listed and listed[-1] == base):  # the next piece of the same parameter
                    listed.append(base)
    index = {n: i for i, n in enumerate(names)}
    if len(listed) == len(index) and set(listed) == set(index):
        return [index[n] for n in listed]
    return order
