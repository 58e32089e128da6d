"""Import an example or benchmark script by path in a test, as ``python path`` would run it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest


def load_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module at ``path``, its siblings importable by plain name (as when run); undone after the test."""
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
