"""A host runs the row check once per build, CPU, model and shape, and keeps the answer."""

from __future__ import annotations

from pathlib import Path

from worker.conclave.row_check import remembered


class Check:
    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.runs = 0

    def __call__(self) -> bool:
        self.runs += 1
        return self.answer


def test_the_check_runs_once_per_key(tmp_path: Path) -> None:
    record = tmp_path / "row-checks.json"
    differ, equal = Check(False), Check(True)
    assert remembered(record, "stock build", differ) is False
    assert remembered(record, "stock build", differ) is False
    assert remembered(record, "row-invariant build", equal) is True
    assert remembered(record, "row-invariant build", equal) is True
    # Each key's own answer, each found once: a False answer is kept like a True one.
    assert (differ.runs, equal.runs) == (1, 1)


def test_a_damaged_record_only_costs_the_check(tmp_path: Path) -> None:
    record = tmp_path / "row-checks.json"
    record.write_bytes(b"\x00{not json")
    check = Check(True)
    assert remembered(record, "key", check) is True
    assert remembered(record, "key", check) is True
    assert check.runs == 1


def test_an_answer_that_is_not_a_bool_is_checked_again(tmp_path: Path) -> None:
    record = tmp_path / "row-checks.json"
    record.write_text('{"key": "yes"}')
    check = Check(False)
    assert remembered(record, "key", check) is False
    assert check.runs == 1
