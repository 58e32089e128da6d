"""Walking nested containers for tensors (a module's outputs, a forward's inputs)."""

from __future__ import annotations

import torch


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) tensor / list / tuple / dict: a module's outputs or a forward's inputs."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


def batch_size(args: tuple[object, ...], kwargs: dict[str, object]) -> int | None:
    """The first dimension of a forward's first tensor argument with one, looking into lists and dicts
    (HuggingFace-style inputs): the per-rank batch the preserver's statistics count samples with."""
    for a in tensors_in(list(args) + list(kwargs.values())):
        if a.dim() > 0:
            return int(a.shape[0])
    return None
