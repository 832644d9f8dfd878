"""When the warmer runs: cron parsing and what a restarted warmer missed (injected times)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.errors import InvalidRequest
from warmer.schedule import cron_trigger, missed_run

NIGHTLY = cron_trigger("0 3 * * *", UTC)


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 11, day, hour, minute, tzinfo=UTC)


def test_a_warmer_that_never_ran_missed_nothing() -> None:
    assert missed_run(NIGHTLY, None, at(30, 9)) is None


def test_no_run_was_due_since_the_last() -> None:
    assert missed_run(NIGHTLY, at(30, 3, 0), at(30, 9)) is None


def test_a_run_exactly_at_its_fire_time_is_not_missed_again() -> None:
    assert missed_run(NIGHTLY, at(30, 3), at(30, 3) + timedelta(seconds=1)) is None


def test_several_missed_runs_are_one_catch_up_the_latest() -> None:
    assert missed_run(NIGHTLY, at(26, 3, 1), at(30, 9)) == at(30, 3)


def test_seconds_field_schedules() -> None:
    every_5s = cron_trigger("*/5 * * * * *", UTC)
    last = at(30, 9)
    assert missed_run(every_5s, last, last + timedelta(seconds=12)) == last + timedelta(seconds=10)


@pytest.mark.parametrize("expression", ["0 3 * *", "61 3 * * *", "every night"])
def test_bad_schedules_are_refused_clearly(expression: str) -> None:
    with pytest.raises(InvalidRequest, match=r"warmer\.schedule"):
        cron_trigger(expression, UTC)
