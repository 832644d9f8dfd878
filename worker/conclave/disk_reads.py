"""Prefixes looked up and read from disk off the model thread.

On slow storage a restore's read takes seconds (a 37 MB Qwen state at 10 MB/s: ~3.7 s); read on
the model thread, it would stop every other stream's decoding for as long. So a starting
stream's lookup (index, heads, the restore-or-recompute choice, the read and its checks) runs
here, on one thread, while the model thread goes on with the others; the model thread then
loads the cells it read (a memory copy).

One read at a time, and the next only once the model thread has taken the last one: a restored
delta is composed into a buffer of this thread's (shared/prefix_cache/deltas.py, `Composer`),
which the next read would overwrite, and a disk serves reads one after another anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Key = TypeVar("Key")
Result = TypeVar("Result")

_STOP = None
CLOSE_WAIT_S = 30.0  # a read under way when the worker stops (a hung network disk: daemon)


class DiskReads(Generic[Key, Result]):
    def __init__(self, wake: threading.Event) -> None:
        """`wake` is set when a read is done."""
        self._wake = wake
        self._requests: queue.SimpleQueue[tuple[Key, Callable[[], Result]] | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[tuple[Key, Result | Exception]] = queue.SimpleQueue()
        self._free = threading.Semaphore(1)  # released when the last read was taken
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="disk-reads", daemon=True)
        self._thread.start()

    def submit(self, key: Key, read: Callable[[], Result]) -> None:
        self._requests.put((key, read))

    def finished(self, wait_s: float = 0.0) -> tuple[Key, Result | Exception] | None:
        """The read done, if one is within `wait_s` (its exception if it raised); the caller
        must then call `taken` once it no longer uses what was read."""
        try:
            return self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()
        except queue.Empty:
            return None

    def taken(self) -> None:
        self._free.release()

    def close(self) -> None:
        self._closing = True
        self._requests.put(_STOP)
        self._free.release()
        self._thread.join(timeout=CLOSE_WAIT_S)

    def _run(self) -> None:
        while True:
            self._free.acquire()
            if self._closing or (request := self._requests.get()) is _STOP:
                return
            key, read = request
            try:
                result: Result | Exception = read()
            except Exception as exc:  # the stream prefills instead; the worker goes on
                log.exception("reading a prefix from disk failed")
                result = exc
            self._done.put((key, result))
            self._wake.set()
