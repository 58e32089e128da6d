"""The package's shape: imports run one way, the facade stays a facade, functions stay short.

The import graph of the ``deft`` package runs one way (docs/DESIGN.md section 2).

Every module's imports are read with ``ast`` (module level and inside functions; ``if TYPE_CHECKING:``
blocks are type-only and exempt) and mapped to layers::

    0 contract   errors, _json, config, profile, schedule (deft/__init__ is the facade: exempt)
    1 solver     deft/solver/*            1 profiler  deft/profiler/*   (they do not import each other)
    2 preserver  deft/preserver/*
    3 runtime    deft/runtime/*
    4 tools      deft/cli.py, deft/solver/cli.py, deft/profiler/cli.py, deft/profiler/report.py,
                 deft/testbed.py
    4 integrations  deft/integrations/* (the trainers' one-line switches; tools and integrations do not
                 import each other)

A module may import its own layer or lower ones; an import of a higher layer, a solver <-> profiler
edge, or a circle among deft's modules fails, naming the module, the line and the edge. The walker
itself is tested on a small package written to a temporary directory, so the check provably can fail.

The facade (``deft/runtime/ddp.py``) stays a facade: at most :data:`FACADE_LINES` lines, no training
mode named in it (it forwards to the one :func:`deft.runtime.mode.start_mode` chose), and no runtime
module sets an attribute of a collaborator it holds (``self._x.y = ...``): a collaborator changes its
state through its own methods (:data:`SET_FROM_OUTSIDE` is empty and stays so). No function in ``deft`` is longer than
:data:`FUNCTION_LINES` lines, ``def`` to its last line. Each checker is also run on a small source
that breaks its rule.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import deft

PACKAGE = Path(deft.__file__).resolve().parent
FACADE = PACKAGE / "runtime" / "ddp.py"
FACADE_LINES = 450
FUNCTION_LINES = 60
#: Attributes of a collaborator still set from outside it (``self._x.y = ...``), each to become a method
#: or a constructor argument of the collaborator's own; the list may only shrink.
SET_FROM_OUTSIDE: set[str] = set()
#: What the facade must not name: the modes are chosen in deft.runtime.mode.
MODE_NAMES = {"local_steps", "LocalSteps", "LocalStepsMode", "ScheduledRun", "local_mode", "scheduled", "SoloMode",
              "solo_mode"}
# deft.profiler.report draws the simulated timeline of a measured profile: a tool over both layer-1 parts
TOOLS = {"deft.cli", "deft.solver.cli", "deft.profiler.cli", "deft.profiler.report", "deft.testbed"}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def imports_of(root: Path) -> tuple[set[str], list[Edge]]:
    """Every module of the package under ``root`` and every import edge between them."""
    pkg = root.name
    modules = {module_name(root, p): p for p in root.rglob("*.py")}
    edges = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # "from deft.x import y" may name a submodule y
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # deft.solver.plan.foo -> deft.solver.plan
                    t = t.rpartition(".")[0]
                if t and t.split(".")[0] == pkg and t != name:
                    edges.append(Edge(name, t, node.lineno))
    return set(modules), edges


def layer(module: str) -> tuple[int, str]:
    if module in TOOLS:
        return 4, "tools"
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    return {"solver": (1, "solver"), "profiler": (1, "profiler"), "preserver": (2, "preserver"),
            "runtime": (3, "runtime"), "integrations": (4, "integrations")}.get(sub, (0, "contract"))


def violations(modules: set[str], edges: list[Edge], facade: str) -> list[str]:
    bad = []
    for e in edges:
        if e.source == facade:
            continue
        (ls, ns), (lt, nt) = layer(e.source), layer(e.target)
        if lt > ls:
            bad.append(f"{e.source}:{e.line} imports {e.target}: {ns} (layer {ls}) must not import {nt} (layer {lt})")
        elif ls == lt == 1 and ns != nt:
            bad.append(f"{e.source}:{e.line} imports {e.target}: the solver and the profiler are independent")
        elif ls == lt == 4 and ns != nt:
            bad.append(f"{e.source}:{e.line} imports {e.target}: the tools and the integrations are independent")
    return bad + circles(modules, [e for e in edges if e.source != facade])


def circles(modules: set[str], edges: list[Edge]) -> list[str]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    found, state, stack = [], dict.fromkeys(modules, 0), []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state[t] == 1:
                found.append(" -> ".join([*stack[stack.index(t):], t]))
            elif state[t] == 0:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if state[m] == 0:
            visit(m)
    return [f"import circle: {c}" for c in found]


def test_deft_imports_run_one_way() -> None:
    modules, edges = imports_of(PACKAGE)
    assert len(modules) > 30 and len(edges) > 50  # the walker really read the package
    assert violations(modules, edges, "deft") == []


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "deft"
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return pkg


def test_the_walker_finds_upward_edges_circles_and_ignores_type_checking(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "schedule.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deft.runtime import ddp\n",
        "solver/plan.py": "def f():\n    from deft.solver import simulate\n",
        "solver/simulate.py": "from deft.solver.plan import f\n",
        "profile.py": "def g():\n    import deft.runtime.ddp\n",
        "runtime/ddp.py": "from . import executor\nfrom ..solver import plan\n",
        "runtime/executor.py": "",
        "profiler/kineto.py": "from deft.solver import plan\n",
    })
    modules, edges = imports_of(pkg)
    found = violations(modules, edges, "deft")
    assert any(v.startswith("deft.profile:2 imports deft.runtime.ddp") for v in found), found  # function-local
    assert any("deft.profiler.kineto:1" in v and "independent" in v for v in found), found
    assert any("import circle: deft.solver.plan -> deft.solver.simulate -> deft.solver.plan" in v for v in found)
    assert not any(v.startswith("deft.schedule") for v in found)  # TYPE_CHECKING import: exempt
    assert Edge("deft.runtime.ddp", "deft.runtime.executor", 1) in edges  # relative imports resolved
    assert Edge("deft.runtime.ddp", "deft.solver.plan", 2) in edges
    assert len(found) == 3


@pytest.mark.parametrize(("module", "expected"), [("deft.solver.plan", 1), ("deft.profiler.nsys", 1),
                                                  ("deft.preserver.noise", 2), ("deft.runtime.ddp", 3),
                                                  ("deft.testbed", 4), ("deft.integrations.lightning", 4),
                                                  ("deft.config", 0)])
def test_layers(module: str, expected: int) -> None:
    assert layer(module)[0] == expected


# -- the facade and the functions' length ------------------------------------------------------------------
def long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` of every function or method over ``limit`` lines, ``def`` to its end."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def set_from_outside(source: str) -> list[str]:
    """Every assignment target ``self._x.y`` (or deeper) in ``source``: an attribute of a collaborator
    the object holds, set by the object instead of by the collaborator."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        while any(isinstance(t, (ast.Tuple, ast.List)) for t in targets):
            targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        for t in targets:
            chain, cur = [], t
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "self" and len(chain) >= 2 and chain[-1].startswith("_"):
                found.append(".".join(["self", *reversed(chain)]))
    return found


def names_in(source: str) -> set[str]:
    """Every name, attribute and imported module or name that ``source``'s code uses."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.update([*(node.module or "").split("."), *(a.name for a in node.names)])
        elif isinstance(node, ast.Import):
            found.update(part for a in node.names for part in a.name.split("."))
    return found


def test_the_facade_stays_small_and_names_no_mode() -> None:
    source = FACADE.read_text(encoding="utf-8")
    assert len(source.splitlines()) <= FACADE_LINES
    assert names_in(source) & MODE_NAMES == set()


def test_no_function_is_longer_than_the_limit() -> None:
    assert long_functions(PACKAGE, FUNCTION_LINES) == []


def test_no_runtime_module_sets_a_collaborators_attribute() -> None:
    found = {t for p in (PACKAGE / "runtime").rglob("*.py") for t in set_from_outside(p.read_text(encoding="utf-8"))}
    assert found - SET_FROM_OUTSIDE == set()


def test_the_shape_checkers_find_what_they_look_for(tmp_path: Path) -> None:
    body = "\n".join(f"    x = {i}" for i in range(59))
    pkg = _write(tmp_path, {"short.py": f"def ok():\n{body}\n", "long.py": f"class C:\n    async def m(self):\n"
                            f"    {body.replace(chr(10), chr(10) + '    ')}\n        return x\n"})
    assert long_functions(pkg, FUNCTION_LINES) == ["deft/long.py:2 m (61 lines)"]
    source = ("class A:\n    def f(self, o):\n        self._b.c = 1\n        self._b.c.d += 1\n"
              "        self._b.e, (self.x, self._f.g) = 1, (2, 3)\n        self._h: int = 0\n"
              "        self.i.j = 1\n        o._b.c = 1\n        self._k.l: int = 1\n")
    assert set_from_outside(source) == ["self._b.c", "self._b.c.d", "self._b.e", "self._f.g", "self._k.l"]
    assert names_in("from deft.runtime.local_steps import X\nif cfg.local_steps:\n    pass\n") >= \
        {"local_steps", "X", "cfg"}
    assert names_in("import deft.runtime.scheduled\n") & MODE_NAMES == {"scheduled"}
