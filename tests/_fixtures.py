"""The read-only trace fixtures in ``../shared/fixtures`` (next to the checkout), for the tests that read them.

:func:`fixture_path` skips a test whose fixture is absent on a developer's machine, with the path it
looked at, but fails it under ``CI=true``: in CI a missing fixture is a broken setup, and a skip would
pass the run without the tests that read real traces.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def fixture_path(name: str, root: Path = SHARED_FIXTURES) -> Path:
    """``root / name`` if it exists; else skip the test (pytest.fail under ``CI=true``)."""
    path = root / name
    if path.exists():
        return path
    reason = f"trace fixture {name!r} not found at {path} (expected in ../shared/fixtures beside the checkout)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; under CI=true a missing fixture fails the run instead of skipping")
    pytest.skip(reason)
