"""How much of the model's decode time the prefix saver may cost.

A save (read a base, compare cells, hash, write, sync) runs on a thread of its own, but on a
2-core host llama.cpp's two threads use both cores, so every CPU millisecond the saver takes
while streams decode lengthens their steps. The OS priority does not solve it: at nice 19 the
saver starved under steady load and its snapshots were dropped (worker/prefix_saver.py).

So the saver pays from a budget. Every decode pass earns `share` of its time; a pass that ran
while a save was under way costs what it took beyond the same pass with no save (the lone
baseline: a moving average per row count, of passes with the saver idle). Before a save the
saver waits while the budget is spent (a deferred save); the queue in front of it is bounded,
so a save that waits too long is dropped when the next snapshot finds the queue full. Over any
stretch of decoding, saves then slow the steps by at most `share` of their time. When no
stream decodes, no pass earns and none costs, and the saver goes at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shared.prefix_cache import PrefixCache
from worker.conclave.drafts import PassCost

CAP_S = 1.0  # the most decode time a budget saves up: a long quiet stretch buys one burst
IDLE_S = 0.25  # no decode pass for this long: the model is not decoding, saves need no budget


class SaveBudget:
    def __init__(self, share: float, accounts: PrefixCache | None = None) -> None:
        """`share`: of decode time, what saves may cost (0: save only while no stream
        decodes); `accounts`: the cache whose counters record it."""
        self._share = share
        self._accounts = accounts
        self._lone = PassCost()
        self._credit_s = 0.0
        self._saving = False
        self._last_pass = 0.0
        self._changed = threading.Condition()

    def passed(self, rows: int, seconds: float) -> None:
        """The model thread ran a decode pass of `rows` rows in `seconds`."""
        with self._changed:
            if self._accounts is not None:
                self._accounts.count(decode_pass_ms=round(seconds * 1000))
            baseline = self._lone.estimate(rows)
            if not self._saving:
                self._lone.record(rows, seconds)
            elif baseline is not None:
                self._credit_s -= seconds - baseline
                if self._accounts is not None:
                    self._accounts.count(
                        saving_steps=1,
                        saving_step_ms=round(seconds * 1000),
                        saving_step_baseline_ms=round(baseline * 1000),
                    )
            self._credit_s = min(CAP_S, self._credit_s + self._share * seconds)
            self._last_pass = time.monotonic()
            self._changed.notify_all()

    def wait_turn(self) -> bool:
        """Block until a save may start; True when it had to wait (it was deferred)."""
        deferred = False
        with self._changed:
            while self._credit_s < 0:
                idle_for = time.monotonic() - self._last_pass
                if idle_for >= IDLE_S:
                    self._credit_s = 0.0  # the debt was decode time; none is being lost now
                    break
                deferred = True
                self._changed.wait(IDLE_S - idle_for)
        if deferred and self._accounts is not None:
            self._accounts.count(saves_deferred=1)
        return deferred

    @contextmanager
    def saving(self) -> Iterator[None]:
        with self._changed:
            self._saving = True
        try:
            yield
        finally:
            with self._changed:
                self._saving = False
