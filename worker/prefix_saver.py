"""Writes prefix snapshots to the cache on a background thread.

A job hands over its snapshot and goes on decoding; the first token never waits for disk. The
queue is bounded: when the disk is slower than the jobs, snapshots are dropped (and counted),
never the jobs slowed.
"""

from __future__ import annotations

import logging
import queue
import threading

from shared.prefix_cache import PrefixCache

log = logging.getLogger(__name__)

_STOP = None
_Snapshot = tuple[PrefixCache, list[int], bytes, tuple[int, ...]]


class PrefixSaver:
    def __init__(self, max_pending: int = 4) -> None:
        self._pending: queue.Queue[_Snapshot | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name="prefix-saver", daemon=True)
        self.dropped = 0
        self._thread.start()

    def submit(
        self, cache: PrefixCache, tokens: list[int], state: bytes, breaks: tuple[int, ...] = ()
    ) -> None:
        """`breaks`: where the prefill ended chunks inside `tokens` besides the block grid."""
        try:
            self._pending.put_nowait((cache, tokens, state, breaks))
        except queue.Full:
            self.dropped += 1
            log.warning("prefix cache writes are behind; dropped a %d-token snapshot", len(tokens))

    def flush(self) -> None:
        """Wait until every submitted snapshot is written (tests, shutdown)."""
        self._pending.join()

    def close(self) -> None:
        self._pending.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._pending.get()) is not _STOP:
            cache, tokens, state, breaks = item
            try:
                cache.save(tokens, state, breaks)
            except Exception:  # the cache must never take the worker down
                log.exception("saving a prefix snapshot failed")
            finally:
                self._pending.task_done()
        self._pending.task_done()
