"""`granary warmer`: queues warm jobs on a schedule; it never loads a model.

Each run queues, on the `warm` queue, the declared specs' documents and the most used
document prefixes learned from traffic. Workers compute them when nothing else waits, and skip
what is cached already, so running often costs little. A run that comes late while the warmer
is up runs once (coalesced, within `misfire_grace_s`); runs due while it was down are caught
up once at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, tzinfo
from functools import partial
from pathlib import Path
from zoneinfo import ZoneInfo

from apscheduler.schedulers.blocking import BlockingScheduler
from redis import Redis

from shared import keys
from shared.job_store import JobStore
from shared.prefix_usage import PrefixUsage
from shared.redis_outage import RedisWaiter
from shared.redis_server import connect
from shared.schemas import WarmItem, WarmTrigger
from shared.settings import Settings
from shared.warm_runs import WarmRuns, WarmRunView
from warmer.schedule import cron_trigger, missed_run
from warmer.specs import declared_items

log = logging.getLogger(__name__)

Clock = Callable[[tzinfo], datetime]


class Warmer:
    def __init__(
        self, settings: Settings, redis: Redis, cwd: Path, clock: Clock = datetime.now
    ) -> None:
        self._settings = settings
        self._redis = redis
        self._cwd = cwd
        self._clock = clock
        self.timezone: tzinfo = _timezone(settings.warmer.timezone)
        self.trigger = cron_trigger(settings.warmer.schedule, self.timezone)
        store = JobStore(redis, settings.jobs.result_ttl_s)
        self._runs = WarmRuns(redis, store, settings)
        self._usage = PrefixUsage(redis)

    def run(self, trigger: WarmTrigger = "schedule") -> WarmRunView:
        """One warm run: declared specs, then learned prefixes; recorded and logged."""
        self._mark_run()
        config = self._settings.warmer
        declared = declared_items(config, self._cwd)
        learned = self._usage.top(config.learned_top_k, config.learned_min_uses)
        items: list[tuple[WarmItem, str | None]] = [(item, None) for item in declared.items]
        items += [(prefix.item, prefix.namespace) for prefix in learned]
        run = self._runs.start(items, trigger, errors=declared.errors)
        for error in declared.errors:
            log.warning("warm run %s: %s", run.id, error)
        log.info(
            "warm run %s (%s): %d declared, %d learned prefixes queued",
            run.id,
            trigger,
            len(declared.items),
            len(learned),
        )
        return run

    def catch_up(self) -> WarmRunView | None:
        """Run once now if a scheduled run was due while the warmer was down."""
        last = self._last_run()
        now = self._clock(self.timezone)
        if last is None:
            self._mark_run()  # first start: nothing was missed, but later downtime will be
            return None
        missed = missed_run(self.trigger, last, now)
        if missed is None or not self._settings.warmer.catch_up:
            return None
        log.info("warm run due at %s was missed while the warmer was down", missed)
        return self.run("catch-up")

    def _mark_run(self) -> None:
        self._redis.set(keys.warmer_last_fire(), self._clock(self.timezone).isoformat())

    def _last_run(self) -> datetime | None:
        raw: bytes | None = self._redis.get(keys.warmer_last_fire())  # type: ignore[assignment]
        return None if raw is None else datetime.fromisoformat(raw.decode())


def _timezone(name: str | None) -> tzinfo:
    if name is not None:
        return ZoneInfo(name)
    local = datetime.now().astimezone().tzinfo
    assert local is not None
    return local


def run_warmer(settings: Settings, run_now: bool = False) -> None:
    redis = connect(settings.redis_url)
    warmer = Warmer(settings, redis, Path.cwd())
    # A run that meets a Redis outage waits for it to end and runs then (its jobs join those
    # already queued), rather than failing or ending the process.
    waiter = RedisWaiter(redis, log)
    scheduler = BlockingScheduler(timezone=warmer.timezone)
    scheduler.add_job(
        partial(waiter.call, warmer.run),
        warmer.trigger,
        id="warm",
        name="warm run",
        coalesce=True,
        max_instances=1,
        misfire_grace_time=settings.warmer.misfire_grace_s,
    )
    if run_now:
        waiter.call(lambda: warmer.run("manual"))
    else:
        waiter.call(warmer.catch_up)
    log.info("warmer started: schedule %r (%s)", settings.warmer.schedule, warmer.timezone)
    try:
        scheduler.start()
    except (KeyboardInterrupt, SystemExit):
        scheduler.shutdown(wait=False)
