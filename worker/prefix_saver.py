"""Writes prefix snapshots to the cache on a background thread.

A job hands over its snapshot and goes on decoding; the first token never waits for disk. The
queue is bounded: when the disk is slower than the jobs, snapshots are dropped (and counted),
never the jobs slowed. For the same reason a snapshot is copied out of llama.cpp once, into a
buffer an earlier one used.

The thread keeps the process's CPU priority. At nice 19 it never took a core from llama.cpp's
threads, but under steady load it starved: the storage bench's back-to-back documents had
their snapshots dropped, and a cache that stops saving under load stops getting faster.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from shared.prefix_cache import PrefixCache
from worker import kv_state

log = logging.getLogger(__name__)

_STOP = None
Buffer = npt.NDArray[np.uint8]
_Snapshot = tuple[PrefixCache, list[int], memoryview, tuple[int, ...], Buffer]
# Buffers kept for the next captures: a fresh one of tens of MB costs its page faults on the
# model thread, a kept one only the copy (for a 37 MB Qwen state 9.9 ms against 4.5 ms:
# docs/BENCHMARKS.md, "where a restore's time goes"). One: snapshots are mostly written one at
# a time, and a kept buffer is as large as the largest state yet (hundreds of MB for a large
# model's context).
KEPT_BUFFERS = 1


class PrefixSaver:
    def __init__(self, max_pending: int = 4) -> None:
        self._pending: queue.Queue[_Snapshot | None] = queue.Queue(max_pending)
        self._spare: queue.SimpleQueue[Buffer] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefix-saver", daemon=True)
        self.dropped = 0
        self._thread.start()

    def snapshot(
        self,
        cache: PrefixCache,
        llama: Llama,
        seq: int,
        tokens: list[int],
        breaks: tuple[int, ...] = (),
    ) -> None:
        """Capture sequence `seq`'s state (covering `tokens`) now, write it later. `breaks`:
        where the prefill ended chunks inside `tokens` besides the block grid."""
        if self._pending.full():  # not even captured: the copy would be thrown away
            self.dropped += 1
            log.warning("prefix cache writes are behind; dropped a %d-token snapshot", len(tokens))
            return
        buffer = self._spare.get_nowait() if not self._spare.empty() else None
        state, buffer = kv_state.capture(llama, seq, buffer)
        self._pending.put_nowait((cache, tokens, state, breaks, buffer))

    def flush(self) -> None:
        """Wait until every submitted snapshot is written (tests, shutdown)."""
        self._pending.join()

    def close(self) -> None:
        self._pending.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._pending.get()) is not _STOP:
            cache, tokens, state, breaks, buffer = item
            try:
                cache.save(tokens, state, breaks)
            except Exception:  # the cache must never take the worker down
                log.exception("saving a prefix snapshot failed")
            finally:
                del state
                if self._spare.qsize() < KEPT_BUFFERS:
                    self._spare.put(buffer)
                self._pending.task_done()
        self._pending.task_done()
