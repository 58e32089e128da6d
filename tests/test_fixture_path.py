"""tests/_fixtures.fixture_path: present -> the path; absent -> skip locally, fail under CI=true."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._fixtures import fixture_path


def test_present_fixture_is_returned(tmp_path: Path) -> None:
    (tmp_path / "trace.sqlite").write_bytes(b"")
    assert fixture_path("trace.sqlite", root=tmp_path) == tmp_path / "trace.sqlite"


def test_absent_fixture_skips_with_its_path_outside_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"'absent\.sqlite' not found at .*absent\.sqlite"):
        fixture_path("absent.sqlite", root=tmp_path)


@pytest.mark.parametrize("value", ["", "false", "1"])
def test_only_ci_true_turns_the_skip_into_a_failure(value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception):
        fixture_path("absent.sqlite", root=tmp_path)


def test_absent_fixture_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"'absent\.sqlite' not found .*under CI=true"):
        fixture_path("absent.sqlite", root=tmp_path)
