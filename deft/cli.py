"""The ``deft`` command: ``deft simulate``, ``deft plan``, ``deft testbed``.

Each subcommand lives in the module that does the work (``add_arguments`` + ``run``); this file only
dispatches, so ``deft --help`` stays fast and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from deft.errors import DeftError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("deft.solver.cli", "simulate every scheme on a profile: table and timeline picture"),
    "plan": ("deft.solver.cli", "plan a DeFT schedule from a profile and compare it with the baselines"),
    "testbed": ("deft.testbed", "build or remove the two-link network-namespace testbed (root)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(name, p)
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args.command, args) or 0)
    except DeftError as e:
        print(f"deft {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
