"""Which sequence of the context holds what.

Every sequence has a KV buffer of its own (`kv_unified` off), of n_ctx cells: a request that
fits n_ctx always fits its sequence, and attention reads only the sequence's own cells, in the
order a lone run lays them out. In one buffer shared by all sequences a row's attention sums
over other sequences' (masked) cells too, in an order that depends on who else is resident:
measured on SmolLM2, 7 of 8 greedy chats run together then differed from their lone runs,
against 8 of 8 equal with a buffer per sequence (docs/BENCHMARKS.md).

When a stream ends, its sequence stays *resident*: its cells are kept for the next prompt that
starts the same way, until the sequence is needed (least recently used first). Only cells
computed by canonical prefill (or restored) are reused, under the same rule as the disk cache
(`restorable_tokens`), so output never depends on what memory held before. A prompt sharing a
busy sequence's prefix gets a copy of its buffer (a memory copy, no model work), cut back.

Rows of several sequences go through one forward pass only when their sequence ids are
consecutive and in increasing order: llama.cpp splits a batch for such a cache at every gap
(`split_equal` in llama-batch.cpp), and each part is a pass of its own that reads every weight
again. So before a batched step the Conclave asks `compact` for one run of sequences, moving a
stream's buffer into a gap when needed (a memory copy, done by llama.cpp before the next decode).

A sequence whose cells hold a whole document prefix is labelled with the document's prefix id
(shared/prefix_usage.py); copies copy the labels and cutting below a prefix drops its label, so
`documents()` is what memory really holds, which the worker advertises for routing
(shared/routing.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import llama_cpp

from shared.prefix_cache import common_prefix_len, restorable_tokens


@dataclass
class Resident:
    """A sequence's cells: positions [0, len(tokens)) hold `tokens`."""

    seq: int
    namespace: str | None
    tokens: list[int] = field(default_factory=list)
    # Cells [0, prefilled) were computed in canonical chunks ending at `breaks` (or restored).
    prefilled: int = 0
    breaks: tuple[int, ...] = ()
    idle: bool = False
    used_at: float = field(default_factory=time.monotonic)
    # Document prefixes the cells hold whole: prefix id -> its tokens.
    documents: dict[str, int] = field(default_factory=dict)

    def label(self, document: tuple[str, int] | None) -> None:
        """Name the document whose prefix the prefilled cells now hold whole."""
        if document is not None and self.prefilled >= document[1]:
            self.documents[document[0]] = document[1]

    def keep_documents(self, cells: int) -> None:
        """Cells from `cells` on are gone: so is any document they held part of."""
        self.documents = {d: n for d, n in self.documents.items() if n <= cells}


def _rank(kept: int, resident: Resident) -> tuple[int, bool, float]:
    """Which of the residents a prompt could keep as much of it takes: an idle one (taken
    over, no copy), the longest idle first, so the cells of a stream that just ended stay the
    longest (a voted question's next sample comes for them)."""
    return kept, resident.idle, -resident.used_at


@dataclass(frozen=True, slots=True)
class Reuse:
    source: Resident
    tokens: int  # cells of `source` the new prompt may keep


class Memory:
    def __init__(
        self, mem: llama_cpp.llama_memory_t, n_seq: int, block_tokens: int, truncatable: bool
    ) -> None:
        self._mem = mem
        self._block_tokens = block_tokens
        self._truncatable = truncatable
        # The kernels' (`restorable_tokens`), once checked.
        self.granule: int | None = None
        self.shape_free = False
        self._n_seq = n_seq
        self._free = set(range(n_seq))
        self._residents: dict[int, Resident] = {}
        # Sources of buffer copies llama.cpp has queued but not made: it makes them at the next
        # decode, reading the source's buffer then (`seq_cp` across streams in llama-kv-cache).
        self._copy_sources: set[int] = set()

    def documents(self) -> frozenset[str]:
        """Document prefixes a new prompt could reuse from memory now."""
        held: set[str] = set()
        for resident in self._residents.values():
            for document, tokens in resident.documents.items():
                # Memory that cannot drop a tail is reused only when nothing follows the prefix.
                if self._truncatable or len(resident.tokens) == tokens:
                    held.add(document)
        return frozenset(held)

    def room(self) -> int:
        """How many streams can start now: each takes a free sequence or an idle one."""
        return len(self._free) + sum(1 for r in self._residents.values() if r.idle)

    def best_reuse(
        self, namespace: str | None, tokens: list[int], limit: int, breaks: tuple[int, ...]
    ) -> Reuse | None:
        """The resident prefix a prompt may keep most of (see `restorable_tokens`)."""
        best: Reuse | None = None
        for resident in self._residents.values():
            if resident.namespace != namespace or resident.prefilled == 0:
                continue
            held = resident.tokens[: resident.prefilled]
            common = common_prefix_len(held, tokens)
            kept = restorable_tokens(
                common,
                resident.prefilled,
                limit,
                self._block_tokens,
                self._truncatable,
                breaks,
                resident.breaks,
                self.granule,
                self.shape_free,
            )
            # Memory that cannot drop a tail is reused only when nothing follows the prefix.
            if not self._truncatable and len(resident.tokens) > kept:
                kept = 0
            if kept > 0 and (
                best is None or _rank(kept, resident) > _rank(best.tokens, best.source)
            ):
                best = Reuse(resident, kept)
        return best

    def claim(
        self,
        namespace: str | None,
        reuse: Reuse | None,
        *,
        decodes: bool = True,
        held: frozenset[int] = frozenset(),
    ) -> Resident:
        """A sequence for a new stream: the reused one if idle, a copy of it, or an empty one.
        A stream that `decodes` takes the lowest free id, one that only holds a prefix (an
        extraction's document, a warm run) the highest; a decoding stream whose sequence would
        lie above `held` prefixes takes the lowest of them instead, which moves up into it. So
        held sequences stay out of the run the decoding ones need: with a hold between them and
        every sequence taken, `compact` has nowhere to move it and every step is two passes.

        The caller checked `room()`. The copy of a busy sequence is made by llama.cpp
        before the next decode; nothing may load a state into the new sequence before then.
        """
        if reuse is not None and reuse.source.idle:
            resident = reuse.source
        else:
            resident = Resident(self._take_seq(decodes, held), namespace)
            self._residents[resident.seq] = resident
            if reuse is not None:  # a buffer per sequence: only whole copies are possible
                llama_cpp.llama_memory_seq_cp(self._mem, reuse.source.seq, resident.seq, -1, -1)
                self._copy_sources.add(reuse.source.seq)
                resident.tokens = list(reuse.source.tokens)
                resident.prefilled = reuse.source.prefilled
                resident.breaks = reuse.source.breaks
                resident.documents = dict(reuse.source.documents)
        self._cut(resident, reuse.tokens if reuse is not None else 0)
        resident.namespace = namespace
        resident.idle = False
        resident.used_at = time.monotonic()
        return resident

    def copy(self, source: Resident, target: Resident) -> None:
        """Give busy `target` a copy of `source`'s buffer, whose cells hold `target`'s tokens
        as far as `source` has written (a twin parting, worker/conclave/loop.py)."""
        llama_cpp.llama_memory_seq_cp(self._mem, source.seq, target.seq, -1, -1)
        self._copy_sources.add(source.seq)
        target.prefilled, target.breaks = source.prefilled, source.breaks
        target.documents = dict(source.documents)

    def keep(self, resident: Resident, cells: int) -> None:
        """Only cells [0, `cells`) of `resident` hold what its tokens say."""
        self._cut(resident, cells)

    def copies_pending(self) -> bool:
        """Whether llama.cpp has copies queued: a state loaded into their source or target
        before they are made would be copied, or copied over, so the loader must have a
        decode run first (see `copies_made`)."""
        return bool(self._copy_sources)

    def copies_made(self) -> None:
        """A decode ran: llama.cpp made every queued copy."""
        self._copy_sources.clear()

    def forget(self, resident: Resident) -> None:
        """Drop a sequence's cells (a failed stream's memory may be half-written)."""
        llama_cpp.llama_memory_seq_rm(self._mem, resident.seq, -1, -1)
        del self._residents[resident.seq]
        self._free.add(resident.seq)

    def forget_idle(self) -> None:
        """Drop every sequence no stream uses."""
        for resident in [r for r in self._residents.values() if r.idle]:
            self.forget(resident)

    def release(self, resident: Resident) -> None:
        """The stream is done: its cells stay for reuse until the sequence is needed."""
        resident.idle = True
        resident.used_at = time.monotonic()

    def _cut(self, resident: Resident, keep: int) -> None:
        if keep == 0:
            llama_cpp.llama_memory_seq_rm(self._mem, resident.seq, -1, -1)
        elif len(resident.tokens) > keep:
            llama_cpp.llama_memory_seq_rm(self._mem, resident.seq, keep, -1)
        resident.tokens = resident.tokens[:keep]
        resident.prefilled = min(resident.prefilled, keep)
        resident.breaks = tuple(b for b in resident.breaks if b <= keep)
        resident.keep_documents(keep)

    def _take_seq(self, decodes: bool, held: frozenset[int]) -> int:
        if not self._free:
            self.forget(self._oldest_idle())
        # Decoding sequences gather at the low ids, holds at the high: fewer moves later.
        seq = min(self._free) if decodes else max(self._free)
        below = [q for q in held if q < seq] if decodes else []
        if below:  # queued before any copy from the moved prefix: llama.cpp makes them in order
            seq = min(below)
            self._move(self._residents[seq], max(self._free))
        self._free.remove(seq)
        return seq

    def compact(self, seqs: set[int], held: frozenset[int] = frozenset()) -> dict[int, int]:
        """Make the busy sequences `seqs` one consecutive run; returns {old: new} for the moved.

        The run is the window that needs the fewest buffer copies among those holding no other
        busy sequence but `held` ones (prefixes held for later forks, nothing computed in them
        any more): those move to a free sequence outside it, idle residents too or are dropped
        when none is free. Nothing may load a state into a moved-from sequence before the next
        decode, which makes the copies in order (see `claim`). No window: nothing moves.
        """
        if not seqs or max(seqs) - min(seqs) + 1 == len(seqs):
            return {}
        window = self._window(seqs, held)
        if window is None:
            return {}
        targets = sorted(q for q in window if q not in seqs)
        movers = sorted(q for q in seqs if q not in window)
        for target in sorted(targets, key=lambda q: q not in held):  # held first: they need a spare
            self._vacate(target, keep_clear=window)
        for old, new in zip(movers, targets, strict=True):
            self._move(self._residents[old], new)
        return dict(zip(movers, targets, strict=True))

    def _window(self, seqs: set[int], held: frozenset[int]) -> range | None:
        pinned = {r.seq for r in self._residents.values() if not r.idle} - seqs - held
        best: tuple[int, range] | None = None
        for low in range(self._n_seq - len(seqs) + 1):
            window = range(low, low + len(seqs))
            if any(q in pinned for q in window):
                continue
            spares = sum(1 for q in self._free if q not in window)
            if sum(1 for q in window if q in held) > spares:
                continue
            # Buffer copies: one per stream moved, one per resident giving way.
            moves = sum(1 for q in seqs if q not in window)
            aside = sum(1 for q in window if q not in seqs and q in self._residents)
            if best is None or moves + aside < best[0]:
                best = (moves + aside, window)
        return None if best is None else best[1]

    def _vacate(self, seq: int, keep_clear: range) -> None:
        """Empty `seq`: its resident moves to a free sequence outside `keep_clear`; an idle one
        is dropped when there is none (`_window` kept one for every held one)."""
        resident = self._residents.get(seq)
        if resident is None:
            return
        spare = min((q for q in self._free if q not in keep_clear), default=None)
        if spare is not None:
            self._move(resident, spare)
        else:
            assert resident.idle, "a held prefix gives way only to a spare sequence"
            self.forget(resident)
        self._free.discard(seq)

    def _move(self, resident: Resident, seq: int) -> None:
        """Copy `resident`'s buffer into the empty sequence `seq` and free its own."""
        old = resident.seq
        llama_cpp.llama_memory_seq_cp(self._mem, old, seq, -1, -1)
        self._copy_sources.add(old)
        llama_cpp.llama_memory_seq_rm(self._mem, old, -1, -1)
        del self._residents[old]
        self._free.discard(seq)
        self._free.add(old)
        resident.seq = seq
        self._residents[seq] = resident

    def _oldest_idle(self) -> Resident:
        return min((r for r in self._residents.values() if r.idle), key=lambda r: r.used_at)
