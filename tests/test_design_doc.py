"""docs/DESIGN.md's module tables name exactly the package's modules.

Section 2's table names every module outside ``deft/runtime/`` by its path from the repository root;
section 5's table ("Modules (one job each)") names every module of ``deft/runtime/`` by its path from
that folder. Package ``__init__.py`` files are not modules with a job of their own and are left out. A
module added, moved or deleted without its row fails here, naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "DESIGN.md"
RUNTIME_HEADING = "### Modules (one job each)"
_CELL_PATH = re.compile(r"`([A-Za-z0-9_/.*]+\.py)`")


def table_after(text: str, heading: str) -> list[str]:
    """The rows of the first markdown table after ``heading`` (header and rule included)."""
    start = text.index(heading)
    rows: list[str] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows


def module_cells(rows: list[str]) -> set[str]:
    """The module paths named in the first two cells of each row (``deft/runtime/*`` style globs left out)."""
    named: set[str] = set()
    for row in rows:
        cells = row.strip("|").split("|")
        for cell in cells[:2]:
            named.update(m for m in _CELL_PATH.findall(cell) if "*" not in m)
    return named


def package_modules(package: Path) -> set[str]:
    """Every module file of ``package`` relative to the repository root, ``__init__.py`` left out."""
    return {p.relative_to(package.parent).as_posix() for p in package.rglob("*.py") if p.name != "__init__.py"}


def documented_modules(text: str) -> set[str]:
    outer = module_cells(table_after(text, "## 2. Layers and modules"))
    runtime = {f"deft/runtime/{name}" for name in module_cells(table_after(text, RUNTIME_HEADING))}
    return outer | runtime


def test_module_tables_equal_the_files() -> None:
    documented = documented_modules(DESIGN.read_text(encoding="utf-8"))
    actual = package_modules(ROOT / "deft")
    assert sorted(actual - documented) == [], "modules without a row in docs/DESIGN.md"
    assert sorted(documented - actual) == [], "rows in docs/DESIGN.md naming no module"


def test_the_check_sees_a_missing_and_a_stale_row(tmp_path: Path) -> None:
    pkg = tmp_path / "deft"
    (pkg / "runtime").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "runtime/__init__.py", "runtime/ddp.py", "runtime/new.py"):
        (pkg / name).write_text("")
    doc = (
        "## 2. Layers and modules\n\n| layer | module | job |\n|---|---|---|\n"
        "| 0 | `deft/config.py` | knobs |\n| 0 | `deft/gone.py` | removed |\n| 3 | `deft/runtime/*` | runtime |\n\n"
        f"{RUNTIME_HEADING}\n\n| module | job |\n|---|---|\n| `ddp.py` | the facade |\n"
    )
    documented = documented_modules(doc)
    actual = package_modules(pkg)
    assert actual - documented == {"deft/runtime/new.py"}
    assert documented - actual == {"deft/gone.py"}
