"""When the warmer runs: a cron trigger, and what a restarted warmer missed while it was down.

APScheduler's coalescing and misfire grace cover runs that come late while the process is up;
runs due while it was down are invisible to it, so the time of the last run is kept in Redis
and compared with the trigger at start (`missed_run`).
"""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo

from apscheduler.triggers.cron import CronTrigger

from shared.errors import InvalidRequest

# The trigger returns times at or after the one it is given: step past a run's own time.
_TICK = timedelta(microseconds=1)
# Enough for a per-second schedule down for a day; the catch-up is one run either way.
_MAX_STEPS = 100_000


def cron_trigger(expression: str, timezone: tzinfo) -> CronTrigger:
    """5 fields (minute hour day month weekday), or 6 with seconds first."""
    fields = expression.split()
    try:
        if len(fields) == 5:
            return CronTrigger.from_crontab(expression, timezone=timezone)
        if len(fields) == 6:
            second, minute, hour, day, month, day_of_week = fields
            return CronTrigger(
                second=second,
                minute=minute,
                hour=hour,
                day=day,
                month=month,
                day_of_week=day_of_week,
                timezone=timezone,
            )
    except ValueError as exc:
        raise InvalidRequest(f"warmer.schedule {expression!r}: {exc}", field="schedule") from exc
    raise InvalidRequest(
        f"warmer.schedule {expression!r} has {len(fields)} fields; cron needs 5 (or 6)",
        field="schedule",
    )


def missed_run(trigger: CronTrigger, last_run: datetime | None, now: datetime) -> datetime | None:
    """The latest scheduled time after `last_run` that has passed, if any.

    However many were missed, one catch-up covers them (a warm run makes the cache current;
    running it twice in a row does nothing more). A warmer that never ran missed nothing.
    """
    if last_run is None:
        return None
    missed = None
    fire = trigger.get_next_fire_time(None, last_run + _TICK)
    for _ in range(_MAX_STEPS):
        if fire is None or fire > now:
            break
        missed = fire
        fire = trigger.get_next_fire_time(fire, fire + _TICK)
    return missed
