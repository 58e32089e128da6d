"""The shared test helpers: fixture_path (skip locally, fail under CI=true) and the reference profiles."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._fixtures import fixture_path
from tests._profiles import example_profile, vgg19


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


def test_vgg19_is_table_ii_of_the_paper() -> None:
    one, two = vgg19(), vgg19(two_links=True)
    # Table I totals: forward 37 ms, backward 93 ms (Table II's microseconds summed by hand: 37166, 93119)
    assert one.forward_s == pytest.approx(37.166e-3) and one.backward_s == pytest.approx(93.119e-3)
    assert one.total_comm_s() == pytest.approx(247.725e-3)  # as printed: bucket 1 is 1968 us
    assert one.link_names == ("nccl",) and two.link_names == ("nccl", "gloo")
    assert two.total_comm_s("gloo") == pytest.approx(1.65 * 247.725e-3)
    assert [b.nbytes for b in one.buckets] == [4 * b.numel for b in one.buckets]
    assert one.buckets[2].numel == 102_764_544  # classifier.0: 25088 * 4096 + 4096
    assert vgg19(alpha_s=5e-4).link("nccl").alpha_s == 5e-4 and one.link("nccl").alpha_s == 0.0


def test_example_profile_is_the_curated_vgg19() -> None:
    ex = example_profile("vgg19")
    assert ex.model == "vgg19" and ex.link_names == ("nccl", "gloo")
    assert ex.total_comm_s() == pytest.approx(257.725e-3)  # bucket 1 corrected to 11968 us
