"""The ``deft`` command: ``deft simulate``, ``deft plan``, ``deft testbed``.

Each subcommand lives in the module that does the work (``add_arguments`` + ``run``); this file only
dispatches. Only the chosen subcommand's module is imported, so ``deft --help`` stays fast and a module
that fails to import breaks its own subcommand (with a one-line error), never the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from deft.errors import DeftError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("deft.solver.cli", "simulate every scheme on a profile: table and timeline picture"),
    "plan": ("deft.solver.cli", "plan a DeFT schedule from a profile and compare it with the baselines"),
    "testbed": ("deft.testbed", "build or remove the multi-link network-namespace testbed (root)"),
}


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the top-level parser has no option taking a value, so it is
    the first argument that does not start with '-'."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def _load(name: str) -> ModuleType:
    module = SUBCOMMANDS[name][0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DeftError(f"cannot load {module} ({e}); is deft installed with its dependencies "
                        "(bash scripts/setup.sh)?") from e


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="deft", description="Plan, simulate and test DeFT schedules.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                _load(name).add_arguments(name, p)
            except DeftError as e:
                print(f"deft {name}: error: {e}", file=sys.stderr)
                return 2
    args = parser.parse_args(argv)
    try:
        return int(_load(args.command).run(args.command, args) or 0)
    except DeftError as e:
        print(f"deft {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
