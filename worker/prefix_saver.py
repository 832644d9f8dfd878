"""Writes prefix snapshots to the cache on a background thread.

A job hands over its snapshot and goes on decoding; the first token never waits for disk. The
queue is bounded: when the disk is slower than the jobs, snapshots are dropped (and counted),
never the jobs slowed. For the same reason a snapshot is copied out of llama.cpp once, into a
buffer an earlier one used. A prefill that passes several snapshot points can capture once,
after its first token (`snapshots`): each point's state is cut from that capture here.

The thread keeps the process's CPU priority. At nice 19 it never took a core from llama.cpp's
threads, but under steady load it starved: the storage bench's back-to-back documents had
their snapshots dropped whether or not saving slowed anything, and a cache that stops saving
under load stops getting faster. It yields only where saving measurably slows decoding
(worker/save_yield.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from contextlib import nullcontext

import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from shared.prefix_cache import PrefixCache, StateLayout, first_cells, parse_state
from worker import kv_state
from worker.save_yield import SaveYield

log = logging.getLogger(__name__)

_STOP = None
Buffer = npt.NDArray[np.uint8]
# A state's tokens and the breaks inside them: what `PrefixCache.save` stores it under.
Cut = tuple[list[int], tuple[int, ...]]
# The cache, the cuts to save, the captured state (parsed when the cuts are shorter than it),
# and the buffer holding it.
_Snapshot = tuple[PrefixCache, list[Cut], memoryview, StateLayout | None, Buffer]
# Buffers kept for the next captures: a fresh one of tens of MB costs its page faults on the
# model thread, a kept one only the copy (for a 37 MB Qwen state 9.9 ms against 4.5 ms:
# docs/BENCHMARKS.md, "where a restore's time goes"). One: snapshots are mostly written one at
# a time, and a kept buffer is as large as the largest state yet (hundreds of MB for a large
# model's context).
KEPT_BUFFERS = 1


class PrefixSaver:
    def __init__(
        self,
        max_pending: int = 4,
        yielding: SaveYield | None = None,
        accounts: PrefixCache | None = None,
    ) -> None:
        """`yielding`: when saves wait for the model (None: never); `accounts`: the
        cache whose counters record the saver's time and drops."""
        self._yielding = yielding
        self._accounts = accounts
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
        if self._behind(len(tokens)):
            return
        state, buffer = self._capture(llama, seq)
        self._pending.put_nowait((cache, [(tokens, breaks)], state, None, buffer))

    def snapshots(
        self,
        cache: PrefixCache,
        llama: Llama,
        seq: int,
        prompt: tuple[list[int], tuple[int, ...]],
        points: Iterable[int],
    ) -> bool:
        """Capture sequence `seq`, which holds `prompt` (its tokens and breaks) and may hold
        more, once now; write later the state of its first `point` cells for each point,
        shortest first (a longer one may then store only its own cells). False when its state
        cannot be cut (a layout shared/prefix_cache/state_layout.py does not know): nothing
        is written, and the caller should capture at each point as it is reached."""
        tokens, breaks = prompt
        cuts = [(tokens[:p], tuple(b for b in breaks if b < p)) for p in sorted(points)]
        if not cuts or self._behind(len(cuts[-1][0])):
            return True
        state, buffer = self._capture(llama, seq)
        layout = parse_state(state)
        if layout is None:
            self._keep(buffer)
            log.warning("this model's states cannot be cut: snapshots are captured as reached")
            return False
        self._pending.put_nowait((cache, cuts, state, layout, buffer))
        return True

    def _behind(self, tokens: int) -> bool:
        if not self._pending.full():
            return False
        # Not even captured: the copy would be thrown away.
        self.dropped += 1
        if self._accounts is not None:
            self._accounts.count(saves_dropped=1)
        log.warning("prefix cache writes are behind; dropped a %d-token snapshot", tokens)
        return True

    def _capture(self, llama: Llama, seq: int) -> tuple[memoryview, Buffer]:
        buffer = self._spare.get_nowait() if not self._spare.empty() else None
        return kv_state.capture(llama, seq, buffer)

    def flush(self) -> None:
        """Wait until every submitted snapshot is written (a warm job, `forget`, shutdown):
        asked for, the writes do not wait for the model."""
        with self._yielding.hurried() if self._yielding else nullcontext():
            self._pending.join()

    def close(self) -> None:
        self._pending.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._pending.get()) is not _STOP:
            cache, cuts, state, layout, buffer = item
            if self._yielding is not None:
                self._yielding.wait_turn()
            started = time.thread_time()
            try:
                with self._yielding.saving() if self._yielding else nullcontext():
                    for tokens, breaks in cuts:
                        self._save(cache, tokens, breaks, state, layout)
                        if self._accounts is not None:
                            self._accounts.count(saves=1)
            except Exception:  # the cache must never take the worker down
                log.exception("saving a prefix snapshot failed")
            finally:
                if self._accounts is not None:
                    self._accounts.count(save_ms=round((time.thread_time() - started) * 1000))
                del state, layout
                self._keep(buffer)
                self._pending.task_done()
        self._pending.task_done()

    def _keep(self, buffer: Buffer) -> None:
        if self._spare.qsize() < KEPT_BUFFERS:
            self._spare.put(buffer)

    @staticmethod
    def _save(
        cache: PrefixCache,
        tokens: list[int],
        breaks: tuple[int, ...],
        state: memoryview,
        layout: StateLayout | None,
    ) -> None:
        if layout is None or layout.n_cells == len(tokens):
            cache.save(tokens, state, breaks)
            return
        cut = first_cells(layout, len(tokens))
        if cut is None:  # its cells are not the prompt's positions in order: nothing to save
            log.warning("a %d-token snapshot could not be cut from its sequence", len(tokens))
            return
        cache.save(tokens, cut.data, breaks)
