"""Every benchmark and example imports against the current package.

The benchmarks are run by hand, rarely, on the testbed; a rename in ``deft`` (a function moving from
one module to another) would otherwise be found only when someone next measures. Importing runs no
benchmark: each keeps its work under ``main()``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_script_imports(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Scripts import their siblings by plain name (bench_links, models), as when run from their folder.
    monkeypatch.syspath_prepend(str(path.parent))
    name = f"_script_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)) or path.parent.name == "examples", \
        f"{path}: a benchmark keeps its work in main()"


def test_scripts_found() -> None:
    assert {"bench_peers.py", "bench_replay.py", "train_cnn.py"} <= {p.name for p in SCRIPTS}


def test_every_import_of_deft_resolves() -> None:
    """``from deft.x import name`` anywhere (function-local imports too, which importing a script does
    not run) names something that exists."""
    import ast
    import importlib

    files = [*sorted((ROOT / "deft").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py")), *SCRIPTS]
    missing = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deft":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if not hasattr(module, alias.name) and importlib.util.find_spec(submodule) is None:
                        missing.append(f"{f.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
