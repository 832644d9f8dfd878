"""What a worker saw of Redis lately: since when its calls have gone through without a stall.

A job's claim in rq's started registry is a score, its owner's clock plus `heartbeat_ttl_s`,
renewed every third of that. While Redis is frozen (SIGSTOP, a stalled host, a partition that
drops packets) or down, no beat lands, and when it answers again every running job's claim
has lapsed: its owner's last beat landed before the outage, or at the thaw carrying a score
reckoned before it (a beat sent on a connection still opening lands after newer ones, and
lowers the score they set). A registry cleanup then would take every running job for
abandoned and run it a second time beside itself. Silence says a job's owner is dead only if
the owner could have spoken: so a worker judges claims only after its own calls have gone
through, unstalled, for a whole `heartbeat_ttl_s` (worker/worker.py `clean_registries`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from shared.log_limit import RateLimitedLog
from shared.redis_outage import REDIS_DOWN

log = logging.getLogger(__name__)

T = TypeVar("T")


class RedisContact:
    """Times the calls given to `timed`, from any thread: one that failed, or took longer than
    `stall_s`, means Redis was away or frozen until it ended."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._stall_s = stall_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lost_at = clock()  # nothing seen yet: contact counts from now
        self._in_flight: dict[int, float] = {}  # a call's start, by a number of its own
        self._numbers = itertools.count()
        self._stalls = RateLimitedLog(log)

    def timed(self, call: Callable[[], T]) -> T:
        number = next(self._numbers)
        with self._lock:
            self._in_flight[number] = self._clock()
        try:
            return call()
        except REDIS_DOWN:
            self._lose(self._clock())
            raise
        finally:
            self._end(number)

    def unbroken_s(self) -> float:
        """Seconds since contact was last lost; 0 while a call has been waiting for longer than
        `stall_s` (Redis stalls now: that call has not come back to say so yet)."""
        with self._lock:
            now = self._clock()
            if any(now - started > self._stall_s for started in self._in_flight.values()):
                return 0.0
            return now - self._lost_at

    def _end(self, number: int) -> None:
        now = self._clock()
        with self._lock:
            took = now - self._in_flight.pop(number)
            if took > self._stall_s:
                self._lost_at = max(self._lost_at, now)
        if took > self._stall_s:  # a frozen Redis fails no call: this is all that says so
            self._stalls.failure("Redis stalled: a call took %.1f s", took)

    def _lose(self, at: float) -> None:
        with self._lock:
            self._lost_at = max(self._lost_at, at)
