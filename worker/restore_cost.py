"""Restore a stored prefix from disk, or prefill its tokens again: whichever costs less.

A restore reads the state's files (a delta's bases too), verifies them and loads the cells; on
a fast disk or from the page cache that is a fraction of prefilling the same tokens, on a slow
or busy disk it can be more. So before a state found on disk is read, the worker compares two
estimates from its own measurements (`RestoreCosts.choose`):

- reading: the bytes the page cache holds (asked of the kernel, nothing read:
  shared/prefix_cache/residency.py) at the rate restores from memory have run, the rest at
  this cache directory's uncached rate: measured once at start on a file of its own, then by
  every restore that read mostly from the disk;
- prefilling: the tokens the restore would give, at the rate this worker's recent prefill
  chunks ran.

The prefill rate is kept in the data directory for the model, build and threads, so a
restarted worker starts from it; before any prefill was ever measured there is nothing to
compare, and the restore is taken. The choice and both estimates go into the job's timings
(`Timings.restore_choice`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from shared.prefix_cache import ReadOffer
from shared.prefix_cache.fingerprint import read_json, write_json
from shared.prefix_cache.residency import uncached_read_rate

SMOOTHING = 0.3  # weight of a new measurement in a rate's moving average
# Bytes per second of a restore from the page cache (reading, verifying, loading) before one is
# measured: a 37 MB Qwen state restores in ~10 ms from memory here (docs/BENCHMARKS.md, "where
# a restore's time goes"); only the order of magnitude matters against a disk.
MEMORY_PRIOR = 2e9
PREFILL_WINDOW = 16  # recent prefill chunks whose tokens and seconds give the prefill rate
MOSTLY = 0.5  # a restore teaches the disk rate when more than this share came from the disk
KEEP_EVERY_S = 60.0  # how often a changed prefill rate is written to its record


class Rate:
    """A moving average of bytes (or tokens) per second."""

    def __init__(self, per_s: float | None = None) -> None:
        self.per_s = per_s

    def record(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        measured = amount / seconds
        known = self.per_s
        self.per_s = measured if known is None else known + SMOOTHING * (measured - known)


@dataclass(frozen=True, slots=True)
class Choice:
    restore: bool
    restore_s: float  # expected
    prefill_s: float | None  # expected; None before any prefill was measured


def choice_timings(choice: Choice | None) -> dict[str, object]:
    """The choice as a job's timings report it (`shared.schemas.Timings`)."""
    if choice is None:
        return {}
    return {
        "restore_choice": "restore" if choice.restore else "recompute",
        "restore_estimate_ms": choice.restore_s * 1000,
        "recompute_estimate_ms": None if choice.prefill_s is None else choice.prefill_s * 1000,
    }


class RestoreCosts:
    def __init__(self, directory: Path | None, record: tuple[Path, str] | None = None) -> None:
        """`directory`: the cache's, whose uncached read rate is measured now, on a thread of
        its own (seconds on a slow disk); None: nothing to measure. `record`: a JSON file and
        the key (naming the model, build and threads) under which the prefill rate is kept."""
        self.memory = Rate(MEMORY_PRIOR)
        self.disk = Rate()
        # Appended by the model thread, read by the thread that reads from disk.
        self._chunks: deque[tuple[float, float]] = deque(maxlen=PREFILL_WINDOW)
        self._chunks_lock = threading.Lock()
        self._record = record
        self._kept_at = -KEEP_EVERY_S  # the first measured chunk is kept at once
        kept = read_json(record[0]).get(record[1]) if record is not None else None
        if isinstance(kept, (int, float)) and kept > 0:
            self._chunks.append((float(kept), 1.0))  # a second's worth, soon outweighed
        if directory is not None:
            threading.Thread(
                target=self._probe, args=(directory,), name="read-probe", daemon=True
            ).start()

    def _probe(self, directory: Path) -> None:
        rate = uncached_read_rate(directory)
        if rate is not None and self.disk.per_s is None:  # a real restore's figure wins
            self.disk.per_s = rate

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill chunk of `tokens` ran in `seconds`."""
        with self._chunks_lock:
            self._chunks.append((tokens, seconds))
        now = time.monotonic()
        if self._record is not None and now - self._kept_at >= KEEP_EVERY_S:
            self._kept_at = now
            path, key = self._record
            write_json(path, {**read_json(path), key: self.prefill_per_s()})

    def prefill_per_s(self) -> float | None:
        with self._chunks_lock:
            tokens = sum(t for t, _ in self._chunks)
            seconds = sum(s for _, s in self._chunks)
        return tokens / seconds if tokens and seconds > 0 else None

    def read_s(self, offer: ReadOffer) -> float:
        memory = self.memory.per_s or MEMORY_PRIOR
        # An unmeasured disk is taken to read as memory does: restore, as before any measure.
        disk = self.disk.per_s or memory
        uncached = offer.bytes - offer.resident_bytes
        return offer.resident_bytes / memory + uncached / disk

    def choose(self, offer: ReadOffer, kept: int) -> Choice:
        """Whether restoring `offer` is expected to cost less than prefilling the tokens it
        would give beyond the `kept` ones memory already gives."""
        restore_s = self.read_s(offer)
        rate = self.prefill_per_s()
        if rate is None:
            return Choice(True, restore_s, None)
        prefill_s = max(offer.tokens - kept, 0) / rate
        return Choice(restore_s <= prefill_s, restore_s, prefill_s)

    def restored(self, offer: ReadOffer, seconds: float) -> None:
        """Learn from a restore of `offer` that took `seconds` in all."""
        uncached = offer.bytes - offer.resident_bytes
        if uncached > MOSTLY * offer.bytes:
            memory_s = offer.resident_bytes / (self.memory.per_s or MEMORY_PRIOR)
            self.disk.record(uncached, seconds - memory_s)
        else:
            self.memory.record(offer.bytes, seconds)
