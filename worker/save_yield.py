"""Saves that yield to decoding: the prefix saver waits while its saves slow the model.

A save (read a base, compare cells, hash, write, sync) runs on a thread of its own, but on a
2-core host llama.cpp's two threads use both cores and spin at every barrier, so any CPU the
saver takes while the model computes lengthens its passes: decode passes beside a save took
several times their time with none (docs/BENCHMARKS.md, "The prefix cache on slow storage").
The OS priority does not solve it: at nice 19 the saver starved under steady load and its
snapshots were dropped, whether or not they would have slowed anything.

So the saver measures what it costs. Each decode pass's time is compared with the same pass (its
row count) run with no save under way: the lone baseline, a moving average. A save whose passes
(those it overlapped at all: most saves are shorter than a pass) took more than `1 + limit`
times their baseline slowed decoding past the limit (the seeds' alarm: 15%); from then on a save
waits while the model is busy (a deferred save), and goes when the model thread waits for work,
or after `RETRY_S`, when one save tries again whether saves still slow it (fewer streams, more
cores). While saves wait, the bounded queue in front of the saver fills and new snapshots are
dropped: both counted. Saves someone waits for (a warm job's, `granary cache forget`, shutdown)
do not wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared.prefix_cache import PrefixCache
from worker.conclave.drafts import PassCost

RETRY_S = 30.0  # after a save slowed decoding too much, the wait before one tries again


class SaveYield:
    def __init__(
        self, limit: float, accounts: PrefixCache | None = None, retry_s: float = RETRY_S
    ) -> None:
        """`limit`: how much slower than their baseline decode passes may run beside a save;
        `accounts`: the cache whose counters record passes and deferred saves."""
        self._limit = limit
        self._retry_s = retry_s
        self._accounts = accounts
        self._lone = PassCost()
        self._saving = False
        self._saved_at = -math.inf  # when the last save ended
        self._beside_s = self._beside_baseline_s = 0.0  # the passes of the save under way
        self._slowed_at: float | None = None  # when a save last slowed decoding past the limit
        self._busy = False  # the model thread is computing, not waiting for work
        self._hurried = 0  # callers waiting for every save to be written
        self._changed = threading.Condition()

    def passed(self, rows: int, seconds: float) -> None:
        """The model thread ran a decode pass of `rows` rows in `seconds`."""
        with self._changed:
            baseline = self._lone.estimate(rows)
            # Beside a save if one ran at any time during the pass: most saves are shorter.
            beside = self._saving or self._saved_at > time.monotonic() - seconds
            if not beside:
                self._lone.record(rows, seconds)
            elif baseline is not None:
                # The last save's passes so far decide whether saves slow the model.
                self._beside_s += seconds
                self._beside_baseline_s += baseline
                slowed = self._beside_s > (1 + self._limit) * self._beside_baseline_s
                self._slowed_at = time.monotonic() if slowed else None
                self._count(
                    saving_steps=1,
                    saving_step_ms=round(seconds * 1000),
                    saving_step_baseline_ms=round(baseline * 1000),
                )
        self._count(decode_pass_ms=round(seconds * 1000))

    def busy(self, busy: bool) -> None:
        """The model thread starts computing (True) or waits for work (False)."""
        with self._changed:
            self._busy = busy
            self._changed.notify_all()

    def wait_turn(self) -> bool:
        """Block until a save may start; True when it had to wait (it was deferred)."""
        deferred = False
        with self._changed:
            while self._busy and self._slowed_at is not None and not self._hurried:
                left = self._slowed_at + self._retry_s - time.monotonic()
                if left <= 0:
                    break
                deferred = True
                self._changed.wait(left)
        if deferred:
            self._count(saves_deferred=1)
        return deferred

    @contextmanager
    def hurried(self) -> Iterator[None]:
        """While inside, saves do not wait: someone waits for them to be written."""
        with self._changed:
            self._hurried += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._hurried -= 1

    @contextmanager
    def saving(self) -> Iterator[None]:
        with self._changed:
            self._saving = True
            self._beside_s = self._beside_baseline_s = 0.0
        try:
            yield
        finally:
            with self._changed:
                self._saving = False
                self._saved_at = time.monotonic()

    def _count(self, **deltas: int) -> None:
        if self._accounts is not None:
            self._accounts.count(**deltas)
