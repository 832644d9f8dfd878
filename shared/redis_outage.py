"""Riding out a Redis outage: wait with backoff until Redis answers again, then carry on.

A worker that exits when Redis goes away loses its loaded model and is restarted into the same
outage; one that waits keeps both its model and its place. Each process logs an outage once per
interval (shared/log_limit.py), not once per failed call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, TypeVar

import redis

from shared.log_limit import RateLimitedLog

# What a Redis client raises when the server is down, restarting or unreachable.
REDIS_DOWN: Final = (redis.ConnectionError, redis.TimeoutError)

T = TypeVar("T")


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Backoff:
    """Delays that double from `first_s` up to `max_s`; `reset` after a success."""

    def __init__(self, first_s: float = 0.1, max_s: float = 2.0) -> None:
        self._first_s = first_s
        self._max_s = max_s
        self._next_s = first_s

    def next(self) -> float:
        delay, self._next_s = self._next_s, min(self._next_s * 2, self._max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self._first_s


class RedisWaiter:
    """Waits out outages of one client's Redis; one per process, shared by its threads."""

    def __init__(
        self,
        client: redis.Redis,
        log: logging.Logger,
        max_delay_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._max_delay_s = max_delay_s
        self._sleep = sleep
        self.outage = RateLimitedLog(log)

    def failed(self, error: BaseException) -> None:
        """Count a failure whose caller retries by itself (logged once per interval)."""
        self.outage.failure("Redis unavailable (%s); waiting for it", describe(error))

    def succeeded(self) -> None:
        """A call went through: ends a run of failures (one line saying how long it lasted)."""
        self.outage.recovered("Redis answers again")

    def wait(self, error: BaseException) -> None:
        """Block until Redis answers a PING; `error` is the failure that brought us here."""
        self.failed(error)
        backoff = Backoff(max_s=self._max_delay_s)
        while True:
            self._sleep(backoff.next())
            try:
                self._client.ping()
            except REDIS_DOWN as exc:
                self.failed(exc)
                continue
            self.succeeded()
            return

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()`, waiting out any outage it meets and calling it again; `fn` must be safe to
        repeat after a failure part-way (idempotent, or atomic in Redis)."""
        while True:
            try:
                return fn()
            except REDIS_DOWN as exc:
                self.wait(exc)
