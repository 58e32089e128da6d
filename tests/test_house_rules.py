"""History lives in benchmarks/RESULTS.md and the git log, not in deft's code.

No line of a module under ``deft/`` may carry a date (``2026-11-27``), the word *session*, or an
ordinal session phrase (*the ninth session*, *the tenth measuring pass*): a comment states the rule
and its reason, and a figure behind a reason is cited by its RESULTS.md section or
``benchmarks/results/*.md`` file. The checker is tested on a small sample, so it provably can fail;
identifiers such as ``start_new_session`` are code and do not count.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import deft

PACKAGE = Path(deft.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))

_ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            r"\d+(?:st|nd|rd|th))")
HISTORY = (
    ("a date", re.compile(r"\b20\d\d-\d\d-\d\d\b")),
    ("a session", re.compile(r"\bsessions?\b", re.IGNORECASE)),
    ("an ordinal session phrase", re.compile(_ORDINAL + r"\s+(?:measuring\s+pass|sitting|session)", re.IGNORECASE)),
)


def history_lines(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what, line)`` for every line of ``text`` that carries history."""
    found = []
    for n, line in enumerate(text.splitlines(), start=1):
        for what, pattern in HISTORY:
            if pattern.search(line):
                found.append((n, what, line.strip()))
                break
    return found


SAMPLE = '''\
"""The codec rule.

Until 2026-11-27 the first iteration went fp16.
(benchmarks/results/slow_links.md, ninth session)
Measured in the Tenth Measuring Pass.
the 11th sitting's figures
"""
proc = subprocess.Popen(argv, start_new_session=True)  # its own process group
SESSION_ID = 3
VERSION = "2.12"  # released 2026
'''


def test_checker_finds_history_in_a_sample() -> None:
    found = history_lines(SAMPLE)
    assert [(n, what) for n, what, _ in found] == [
        (3, "a date"), (4, "a session"), (5, "an ordinal session phrase"),
        (6, "an ordinal session phrase"),
    ]


def test_checker_passes_code_and_plain_prose() -> None:
    clean = ("proc = subprocess.Popen(argv, start_new_session=True)\n"
             "# the first pass over the buckets; 20 buckets at 2026 bytes each\n"
             "DATE_FORMAT = '%Y-%m-%d'\n")
    assert history_lines(clean) == []


def test_the_package_is_walked() -> None:
    names = {p.relative_to(PACKAGE).as_posix() for p in MODULES}
    assert {"config.py", "runtime/ddp.py", "solver/plan.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_history_in_deft(path: Path) -> None:
    found = history_lines(path.read_text(encoding="utf-8"))
    assert found == [], "\n".join(f"deft/{path.relative_to(PACKAGE).as_posix()}:{n}: {what}: {line}"
                                  for n, what, line in found)
