"""The README's reference links: each label defined once (Markdown takes the first of two, silently),
each one used defined, each local target present. The checker is tested on a sample, so it can fail."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DEFINITION = re.compile(r"^\[([^\]]+)\]:\s*(\S+)", re.MULTILINE)
_USE = re.compile(r"\]\[([^\]]+)\]")


def link_problems(text: str, root: Path) -> list[str]:
    """What is wrong with ``text``'s reference links: a label defined twice, a label used and never
    defined, a local target (not a URL) missing under ``root``."""
    problems = []
    seen: dict[str, str] = {}
    for label, target in _DEFINITION.findall(text):
        if label in seen:
            problems.append(f"[{label}] defined twice: {seen[label]} and {target}")
        seen[label] = target
        if "://" not in target and not (root / target.split("#")[0]).exists():
            problems.append(f"[{label}]: {target} does not exist")
    problems += [f"[{label}] used, never defined" for label in sorted(set(_USE.findall(text)) - set(seen))]
    return problems


def test_the_checker_finds_a_twice_defined_an_undefined_and_a_missing_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("a", encoding="utf-8")
    sample = "see [one][a] and [two][b] and [three][c]\n\n[a]: a.md\n[b]: a.md\n[a]: b.md\n"
    assert link_problems(sample, tmp_path) == ["[a] defined twice: a.md and b.md", "[a]: b.md does not exist",
                                               "[c] used, never defined"]


def test_the_readmes_links_are_sound() -> None:
    assert link_problems((ROOT / "README.md").read_text(encoding="utf-8"), ROOT) == []
