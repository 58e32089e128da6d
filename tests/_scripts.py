"""Run an example or benchmark script in a test, as ``python path`` would run it.

``load_script`` imports it in the test process (its functions, its argument parser); ``run_script`` runs it
whole in ``world`` ranks forked from the suite's forkserver (:mod:`tests._dist`), as torchrun would start
it: the ``env://`` variables set, the script joining the job itself, ``sys.argv`` its arguments and its
directory first on ``sys.path``. A rank forks from a process that has imported torch and deft, so a run
costs the script's own work, not a fresh interpreter's imports per rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import runpy
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests._dist import run_ranks, values

if TYPE_CHECKING:
    import pytest

# what a test's launch must not inherit from the environment pytest runs in
UNSET = ("DEFT_CONFIG", "GLOO_SOCKET_IFNAME")


def load_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module at ``path``, its siblings importable by plain name (as when run); undone after the test."""
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_script_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def script_rank(rank: int, world: int, path: str, argv: list[str], env: dict[str, str]) -> str:
    """One rank (tests._dist.run_ranks, no group set up): ``python path *argv`` with ``env`` on top of the
    launch's; what it printed (``sys.stdout``). A non-zero exit status fails the rank."""
    for var in UNSET:
        os.environ.pop(var, None)
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **env)
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).parent))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"{Path(path).name} exited with {e.code!r}") from None
    return printed.getvalue()


def run_script(path: Path, argv: list[str], world: int = 2, env: dict[str, str] | None = None,
               timeout: float = 180) -> list[str]:
    """``path`` run in ``world`` ranks, as ``torchrun --nproc-per-node world path *argv`` runs it: what each
    rank printed; fails with every rank's error if a rank fails or outlives ``timeout``."""
    printed: list[str] = values(run_ranks(script_rank, world, (str(path), argv, env or {}), timeout=timeout,
                                          init_group=False))
    return printed
