"""Logging a failure that repeats: the first at once, then one line per interval with a count.

During an outage the same call fails many times a second (13 s without Redis once wrote 6,493
lines, a traceback each); after the first line, each says only that it happened again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """One kind of failure, from any thread: logged once per `interval_s` while it repeats."""

    def __init__(
        self,
        log: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the current run of failures began
        self._total = 0  # failures in the current run
        self._unlogged = 0  # failures since the last line
        self._last_line = 0.0

    def failure(self, message: str, *args: object, exc_info: BaseException | None = None) -> None:
        """Count one failure; log it if it starts a run or `interval_s` passed since the last."""
        with self._lock:
            now = self._clock()
            self._total += 1
            if self._since is None:
                self._since = self._last_line = now
                count = 0
            else:
                self._unlogged += 1
                if now - self._last_line < self._interval_s:
                    return
                count, self._unlogged = self._unlogged, 0
                elapsed, self._last_line = now - self._last_line, now
        text = message % args if args else message
        if count:
            text = f"{text} ({count} more in the last {elapsed:.0f} s)"
        self._log.warning("%s", text, exc_info=exc_info)

    def recovered(self, message: str, *args: object) -> None:
        """End a run of failures with one line saying how many there were; silent if none."""
        with self._lock:
            if self._since is None:
                return
            total, lasted = self._total, self._clock() - self._since
            self._since, self._total, self._unlogged = None, 0, 0
        text = message % args if args else message
        self._log.info("%s (after %d failures over %.1f s)", text, total, lasted)
