"""Walking nested containers for tensors (a module's outputs, a forward's inputs)."""

from __future__ import annotations

from typing import Any

import torch


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tensor / list / tuple / dict: a module's outputs or a forward's inputs."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []
