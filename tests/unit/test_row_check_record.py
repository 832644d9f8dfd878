"""A host runs each start-up check once per build, CPU, model and shape, and keeps the answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.conclave.row_check import remembered


class Check:
    def __init__(self, answer: bool | int | None) -> None:
        self.answer = answer
        self.runs = 0

    def __call__(self) -> bool | int | None:
        self.runs += 1
        return self.answer


def a_bool(kept: object) -> bool:
    return isinstance(kept, bool)


def a_granule(kept: object) -> bool:
    return kept is None or type(kept) is int


def test_the_check_runs_once_per_key(tmp_path: Path) -> None:
    record = tmp_path / "row-checks.json"
    differ, equal, none = Check(False), Check(True), Check(None)
    for _ in range(2):
        assert remembered(record, "rows:stock build", differ, a_bool, str) is False
        assert remembered(record, "rows:row-invariant build", equal, a_bool, str) is True
        # A None answer (no granule found) is kept like any other.
        assert remembered(record, "slices:stock build", none, a_granule, str) is None
    assert (differ.runs, equal.runs, none.runs) == (1, 1, 1)


def test_a_damaged_record_only_costs_the_check(tmp_path: Path) -> None:
    record = tmp_path / "row-checks.json"
    record.write_bytes(b"\x00{not json")
    check = Check(4)
    assert remembered(record, "key", check, a_granule, str) == 4
    assert remembered(record, "key", check, a_granule, str) == 4
    assert check.runs == 1


@pytest.mark.parametrize("kept", ['"yes"', '"4"', "[]", "true"])
def test_an_answer_of_another_shape_is_checked_again(tmp_path: Path, kept: str) -> None:
    record = tmp_path / "row-checks.json"
    record.write_text(f'{{"key": {kept}}}')
    check = Check(8)
    assert remembered(record, "key", check, a_granule, str) == 8
    assert check.runs == 1
