"""Suite-wide checks on the tests themselves."""

from __future__ import annotations

from typing import Any

import pytest

from tests import _dist


@pytest.fixture(autouse=True)
def _ranks_only_in_slow_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts ranks (``tests._dist.run_ranks``) must be marked ``slow``: the fast lane
    (``scripts/test.sh --fast``) selects tests by that marker, and an unmarked multi-process test would
    run there unnoticed."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{request.node.nodeid} starts ranks but is not marked @pytest.mark.slow")

    monkeypatch.setattr(_dist, "_context", refuse)
