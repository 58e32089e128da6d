"""The run's records as users read them (``ddp.plan_info``) and as a checkpoint brings them back."""

from __future__ import annotations

import json

import pytest

from deft.errors import DeftError
from deft.runtime.records import RunRecord


def test_uses_before_the_forward_are_counted_from_the_first() -> None:
    record = RunRecord()
    assert "used_before_forward" not in record.view()
    record.used(3, "Tensor.detach on head.weight")
    record.used(4, "Tensor.mul_ on body.0.weight")
    assert record.view()["used_before_forward"] == {"iterations": 2, "first_iteration": 3,
                                                    "first": "Tensor.detach on head.weight"}


def test_a_checkpoints_plan_info_brings_the_record_back() -> None:
    record = RunRecord()
    record.used(7, "Tensor.detach on head.weight")
    record.skipped_steps.append(2)
    back = RunRecord.from_view(json.loads(json.dumps(record.view())))
    assert back.view() == record.view()


def test_a_damaged_record_names_its_field() -> None:
    with pytest.raises(DeftError, match=r"plan_info\.used_before_forward: expected an object, got 3"):
        RunRecord.from_view({"used_before_forward": 3})
