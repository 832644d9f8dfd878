"""Shared cache of KV-cache states keyed by token prefix: lookup, save, budget, maintenance.

Files inside a :class:`~shared.prefix_cache.blobs.BlobStore` are laid out as
shared.prefix_cache.format describes: ``fp`` is the model fingerprint, ``n`` the blob's token
count, ``id`` its prefix key and ``bkey`` a boundary key (see shared.prefix_cache.keys). A
blob has a marker at every boundary <= n: each full block plus power-of-two lengths below
one block, i.e. O(n / block + log block) tiny files. Lookup lists the prompt's
boundary directories from longest to shortest and stops at the first usable
blob, so its cost depends on the prompt length, not on the number of entries.
``blobs/`` and ``hits/`` are flat so one directory scan yields every size,
last-use time (mtime) and hit count for the budget.

Correctness never depends on process memory or locks: blobs are written by
atomic rename under a content-derived name, every read is verified, and any
inconsistency (corrupt blob, marker without blob) is repaired by deleting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.prefix_cache.blobs import BlobStore, DirectoryBlobStore
from shared.prefix_cache.deltas import (
    MIN_SHARED_CELLS,
    BrokenChain,
    Composer,
    Link,
    Plan,
    link_from,
    resolve,
)
from shared.prefix_cache.deltas import plan as plan_delta
from shared.prefix_cache.eviction import HOT_HITS, Stored, eviction_order, fingerprints, scan
from shared.prefix_cache.fingerprint import cache_fingerprint
from shared.prefix_cache.format import (
    FINGERPRINT,
    HEADER,
    MAX_BREAKS,
    Header,
    blob_key,
    blob_name,
    encode_blob,
    head_bytes,
    hits_key,
    index_dir,
    name_tokens,
    parse_head,
    parse_name,
)
from shared.prefix_cache.keys import (
    Boundary,
    block_hashes,
    boundaries,
    common_prefix_len,
    prefix_key,
)
from shared.prefix_cache.maintenance import VerifyReport, verify_blobs

logger = logging.getLogger(__name__)

HIT_COUNT_CAP = 16  # a blob's hits file grows a byte per hit up to this
MAX_PROBES = 4
MAX_CHAIN_FILES = 64  # a delta's chain is far shorter; the bound only guards a damaged one
_BASE_LATER_S = 1e-3  # how much later than its dependent a base counts as used

if TYPE_CHECKING:
    from shared.settings import Settings


@dataclass(frozen=True, slots=True)
class CacheHit:
    n_tokens: int  # restore the state, then keep only this many tokens
    state: memoryview  # read-only, into the blob as read (a mapped file: no copy)
    blob_tokens: int  # tokens the state actually holds (>= n_tokens)
    key: str


@dataclass(frozen=True, slots=True)
class ReadOffer:
    """A stored state a lookup found, before a byte of it is read: what restoring it would
    give and what it would read."""

    tokens: int  # of the prompt, restored
    bytes: int  # every file the restore reads (a delta's bases too)
    resident_bytes: int  # of those, what the page cache holds now


# Whether a restore is worth its read (worker/restore_cost.py); a lookup that is told no
# reads nothing more and finds nothing.
ReadPays = Callable[[ReadOffer], bool]


class _NotWorthReading(Exception):
    pass


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    hit_tokens: int
    bytes_read: int
    bytes_written: int
    evictions: int
    store_bytes: int  # all fingerprints: what max_bytes is enforced against


@dataclass(frozen=True, slots=True)
class EntryInfo:
    key: str
    n_tokens: int
    bytes: int
    last_used_s: float
    hits: int

    @property
    def last_used(self) -> float:
        return self.last_used_s


# Per-process counters, with what each counts; workers sum them in Redis
# (shared.prefix_cache.counters). The first six are the disk cache's own, the rest what a worker
# counts of its memory, restores and saves (worker/restore_cost.py, worker/save_yield.py).
COUNTERS = {
    "hits": "Prompts that restored a prefix from disk",
    "misses": "Disk lookups that found no prefix",
    "hit_tokens": "Prompt tokens restored from disk",
    "bytes_read": "Bytes of states restored from disk",
    "bytes_written": "Bytes of states written to disk",
    "evictions": "States removed to keep the disk budget",
    "prompts": "Prompts a worker started to read",
    "memory_hits": "Prompts that started from a prefix in worker memory, none longer on disk",
    "memory_hit_tokens": "Prompt tokens reused from worker memory",
    "restores_skipped": "Prefixes on disk not read: prefilling them was expected to cost less",
    "restore_ms": "Time reading, verifying and loading the states restored",
    "prefill_saved_ms": "Expected time of prefilling the tokens restored instead",
    "saves": "Snapshots the saver wrote (or found stored)",
    "save_ms": "CPU time the saver spent writing snapshots",
    "saves_deferred": "Snapshots that waited for the model: saves had slowed decoding too much",
    "saves_dropped": "Snapshots never written: the saver was too far behind",
    "decode_pass_ms": "Time of every decode pass",
    "saving_steps": "Decode passes a save ran beside (at any time during the pass)",
    "saving_step_ms": "Time of the decode passes a save ran beside",
    "saving_step_baseline_ms": "Time the same decode passes took with no save under way",
}


# The rows a pass needs before every kernel of a prompt chunk has taken its batched path (the
# tiled K-quant path: from 8 rows), with room for builds that switch later: a restore inside a
# chunk leaves the rest of it this many tokens at least (`restorable_tokens`).
MIN_PASS_ROWS = 32


def chunk_end(position: int, limit: int, block_tokens: int, breaks: Collection[int]) -> int:
    """Where the prefill chunk starting at `position` ends: the next block boundary, break or
    `limit`, whichever comes first (worker/chunk_ends.py says why)."""
    return min(
        position - position % block_tokens + block_tokens,
        limit,
        *(b for b in breaks if b > position),
    )


def restorable_tokens(
    common: int,
    stored: int,
    limit: int,
    block_tokens: int,
    truncatable: bool,
    breaks: Collection[int] = (),
    stored_breaks: Collection[int] = (),
    granule: int | None = None,
    shape_free: bool = False,
) -> int:
    """How many tokens of a stored prefix a prompt may restore so warm output equals cold.

    `stored`: tokens of the stored state; `common`: how many of them the prompt shares;
    `limit`: the prompt's length minus the one token always decoded fresh. Workers prefill in
    chunks that end at multiples of `block_tokens`, at `limit` and at the prompt's `breaks`
    (where a shared prefix such as a document ends), and a KV cell's values depend on the
    shape of the chunk that computed it (docs/BENCHMARKS.md measures it). So a restore may end
    only where both the stored state's prefill and the prompt's own cold prefill ended a chunk,
    with every earlier chunk end shared: at a block boundary or a common break, or at the
    stored state's end when the prompt's cold run ends a chunk there too. A longer state is
    cut back, which only plain-attention memories allow. `stored_breaks`: the stored state's
    breaks (states on disk end at their only break, so they have none inside).

    `granule`: on this host's kernels (worker/conclave/row_check.py, `slice_granule`) a
    pass's rows are grouped from its first, a group's arithmetic differing from a leftover
    row's, and a pass of at least MIN_PASS_ROWS rows takes the same paths whatever its length.
    Then a state cut back inside a chunk read in such a pass, at a multiple of `granule` from
    the chunk's start, holds the cold run's cells, and the rest of the chunk read from there,
    MIN_PASS_ROWS rows at least, is grouped and computed as the cold run's: the restore may
    end there instead of at the chunk's start.

    `shape_free`: on this host's kernels a prompt row reads alike in any pass, a lone one too
    (row_check.py's slice and shared-pieces checks), so no cell depends on where chunks ended:
    a restore may end at any shared token the state holds or can be cut back to.
    """
    n = min(common, limit, stored)
    if shape_free and (truncatable or n == stored):
        return n
    ours = {b for b in breaks if b < n}
    theirs = {b for b in stored_breaks if b < n}
    # After a chunk end only one side had, cells were computed in differently shaped batches.
    n = min([n, *(ours ^ theirs)])
    if n == stored and (n == limit or n % block_tokens == 0 or n in breaks):
        return n
    if not truncatable:
        return 0
    both = {b for b in breaks if b in stored_breaks and b <= n}
    start = max([n - n % block_tokens, *both])  # of the chunk both prefills read `n` in
    if granule is None or n - start < MIN_PASS_ROWS:
        return start
    rest = chunk_end(start, limit, block_tokens, breaks) - MIN_PASS_ROWS
    return start + max(0, min(n, rest) - start) // granule * granule


class PrefixCache:
    """Longest-prefix KV-state cache over a shared :class:`BlobStore`.

    The budget applies to the whole store, all fingerprints included, because the disk is
    what is shared; shared.prefix_cache.eviction says what goes first.
    """

    def __init__(
        self,
        store: BlobStore,
        fingerprint: str,
        block_tokens: int = 256,
        max_bytes: int = 10 * 2**30,
        truncatable: bool = True,
        *,
        clock: Callable[[], float] = time.time,
        hot_hits: int = HOT_HITS,
        max_probes: int = MAX_PROBES,
        deltas: bool = True,
    ) -> None:
        if not FINGERPRINT.fullmatch(fingerprint):
            raise ValueError(f"fingerprint must be a safe path segment: {fingerprint!r}")
        if block_tokens < 1 or max_bytes < 0:
            raise ValueError("block_tokens must be >= 1 and max_bytes >= 0")
        self._store = store
        self._fp = fingerprint
        self._block_tokens = block_tokens
        self._max_bytes = max_bytes
        self._truncatable = truncatable
        self._clock = clock
        self._hot_hits = hot_hits
        self._max_probes = max_probes
        self._deltas = deltas
        # Set by the worker once its kernels are checked (`restorable_tokens`); until then, and
        # for every other reader, restores end at chunk ends.
        self.granule: int | None = None
        self.shape_free = False
        self._composer = Composer()
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._write_failures = 0

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ---- lookup -----------------------------------------------------------

    def lookup(
        self,
        prompt_tokens: Sequence[int],
        min_tokens: int = 1,
        breaks: Collection[int] = (),
        pays: ReadPays | None = None,
    ) -> CacheHit | None:
        """Longest usable cached prefix of at least `min_tokens`; never raises for bad files.

        `min_tokens` lets a caller that already holds a prefix in memory skip reading blobs
        that could not beat it; `breaks` are the prompt's extra chunk ends (see
        `restorable_tokens`); `pays` is asked before the best state found is read (a shorter
        one reads as much per token, so none is read when it says no).
        """
        tokens = list(prompt_tokens)
        hit: CacheHit | None = None
        if len(tokens) >= 2:  # the last prompt token is always decoded fresh
            try:
                hit = self._find(tokens, min_tokens, frozenset(breaks), pays)
            except _NotWorthReading:
                self.count(restores_skipped=1)
                return None
            except OSError as exc:
                logger.warning("prefix cache lookup failed, treating as miss: %s", exc)
        if hit is None:
            self.count(misses=1)
        else:
            self.count(hits=1, hit_tokens=hit.n_tokens, bytes_read=len(hit.state))
        return hit

    def _find(
        self, tokens: list[int], min_tokens: int, breaks: frozenset[int], pays: ReadPays | None
    ) -> CacheHit | None:
        chain = block_hashes(tokens, self._block_tokens, self._fp)
        # A blob found at a boundary is shorter than the next longer boundary (else it would
        # have been found there), so once that bound drops below min_tokens, stop.
        upper = len(tokens) - 1
        for boundary in reversed(boundaries(tokens, self._block_tokens, self._fp, chain=chain)):
            if upper < min_tokens:
                return None
            upper = boundary.n_tokens
            marker_dir = index_dir(self._fp, boundary.key)
            names = self._store.list(marker_dir)
            if names:
                hit = self._best_at(tokens, chain, marker_dir, names, min_tokens, breaks, pays)
                if hit is not None:
                    return hit
        return None

    def _best_at(
        self,
        tokens: list[int],
        chain: list[str],
        marker_dir: str,
        names: list[str],
        min_tokens: int,
        breaks: frozenset[int],
        pays: ReadPays | None,
    ) -> CacheHit | None:
        """Try the candidates sharing one boundary with the prompt, best first."""
        limit = len(tokens) - 1
        ranked: list[tuple[int, str]] = []  # (usable tokens, blob name)
        unknown: list[tuple[int, str]] = []  # (upper bound, blob name)
        for name in names:
            parsed = parse_name(name)
            if parsed is None:
                self._best_effort(self._store.delete, marker_dir + name)  # junk in the index
                continue
            n, blob_id = parsed
            if n <= len(tokens) and blob_id == prefix_key(
                tokens, self._block_tokens, self._fp, n_tokens=n, chain=chain
            ):
                bounds = self._usable_bounds(n, limit, breaks)
                if pays is not None and not self._may_pay(name, max(bounds), pays):
                    raise _NotWorthReading  # known before its head is read
                usable = self._usable_prefix(name, n, limit, breaks, bounds)
                if usable > 0:
                    ranked.append((usable, name))
            elif self._truncatable:
                unknown.append((min(n, limit), name))
        if self._truncatable:
            ranked += self._probe(tokens, marker_dir, unknown, ranked, breaks)
        for usable, name in sorted(ranked, reverse=True):
            if usable < min_tokens:
                break
            if pays is not None and not self._worth_reading(name, usable, pays):
                raise _NotWorthReading
            hit = self._load(tokens, marker_dir, name, breaks)
            if hit is not None:
                return hit
        return None

    def _probe(
        self,
        tokens: list[int],
        marker_dir: str,
        unknown: list[tuple[int, str]],
        known: list[tuple[int, str]],
        breaks: frozenset[int],
    ) -> list[tuple[int, str]]:
        """Read token headers of a few diverging blobs to find mid-block matches.

        Capped at ``max_probes`` so a boundary shared by many entries (a common
        system prompt) costs a constant number of reads.
        """
        best_known = max((n for n, _ in known), default=0)
        out: list[tuple[int, str]] = []
        for upper, name in sorted(unknown, reverse=True)[: self._max_probes]:
            if upper <= best_known:
                break
            head = self._read_head(self._fp, name)
            if head is None:
                self._best_effort(
                    self._forget, self._fp, name, None, self._block_tokens, marker_dir + name
                )
                continue
            header, blob_tokens = head
            common = common_prefix_len(blob_tokens, tokens)
            usable = self.usable(common, len(blob_tokens), len(tokens) - 1, breaks, header.breaks)
            if usable > 0:
                out.append((usable, name))
        return out

    def _usable_bounds(self, n: int, limit: int, breaks: frozenset[int]) -> tuple[int, int]:
        """What a prompt may restore of a stored state of its first `n` tokens, known without
        reading it: whatever breaks the state records, and at best (the state's are ours)."""
        return self.usable(n, n, limit, breaks), self.usable(n, n, limit, breaks, breaks)

    def _may_pay(self, name: str, upper: int, pays: ReadPays) -> bool:
        """Whether blob `name` could be worth reading for the `upper` tokens its breaks could
        at most let the prompt restore: asked before its head is read (on a slow disk even a
        head costs a read)."""
        alone = self._alone(name, upper)
        return upper < 1 or alone is None or pays(alone)

    def _worth_reading(self, name: str, tokens: int, pays: ReadPays) -> bool:
        """Asked first of blob `name` alone, from its size (a delta's chain reads more, so if
        that does not pay, nothing is read to learn the rest), then, for a delta, of its whole
        chain."""
        alone = self._alone(name, tokens)
        if alone is None:
            return True  # gone: the load finds it so and repairs the index
        if not pays(alone):
            return False
        chain = self._offer(name, tokens)
        return chain == alone or pays(chain)

    def _alone(self, name: str, tokens: int) -> ReadOffer | None:
        """Reading blob `name` alone, from its size and what the page cache holds of it."""
        key = blob_key(self._fp, name)
        stat = self._store.stat(key)
        if stat is None:
            return None
        return ReadOffer(tokens, stat.size_bytes, self._store.resident_bytes(key) or 0)

    def _offer(self, name: str, tokens: int) -> ReadOffer:
        """What restoring blob `name` would read: it and, for a delta, its bases (their heads
        name them), and how much of that the page cache holds."""
        total = resident = 0
        current: str | None = name
        for _ in range(MAX_CHAIN_FILES):
            if current is None:
                break
            key = blob_key(self._fp, current)
            stat = self._store.stat(key)
            head = self._read_head(self._fp, current)
            if stat is None or head is None:
                break  # the load finds it broken and repairs the index
            total += stat.size_bytes
            resident += self._store.resident_bytes(key) or 0
            base = head[0].base
            current = None if base is None else base.name
        return ReadOffer(tokens, total, resident)

    def _usable_prefix(
        self, name: str, n: int, limit: int, breaks: frozenset[int], bounds: tuple[int, int]
    ) -> int:
        """What a prompt may restore of a stored state of its first `n` tokens: from the name
        alone where the state's breaks cannot matter (`bounds` agree), else from the breaks
        its head records (a small read). Ranking by the name alone would pass over every state
        with a break inside it before the first block boundary (a system prompt's end, say)."""
        usable, at_best = bounds
        if usable == at_best:
            return usable
        head = self._read_head(self._fp, name)
        return usable if head is None else self.usable(n, n, limit, breaks, head[0].breaks)

    def _read_tokens(self, fp: str, name: str) -> list[int] | None:
        head = self._read_head(fp, name)
        return None if head is None else head[1]

    def _read_head(self, fp: str, name: str) -> tuple[Header, list[int]] | None:
        parsed = parse_name(name)
        if parsed is None:
            return None
        n = parsed[0]
        data = self._store.get_head(blob_key(fp, name), head_bytes(fp, n))
        result = None if data is None else parse_head(data, fp)
        if result is None or result[0].n_tokens != n:
            return None
        return result

    def _load(
        self, tokens: list[int], marker_dir: str, name: str, breaks: frozenset[int]
    ) -> CacheHit | None:
        """Read and fully verify one blob (a delta: its whole chain); remove what is bad."""
        n_named, blob_id = parse_name(name) or (-1, "")
        key = blob_key(self._fp, name)
        data = self._store.get(key)
        link = None if data is None else link_from(self._fp, name, data, with_layout=False)
        if link is None or link.header.block_tokens != self._block_tokens:
            if data is not None:
                logger.warning("prefix cache: removing corrupt blob %s", key)
            # All its markers when its tokens are known (a prefix of the prompt's), so shorter
            # boundaries of this lookup no longer offer it ahead of the blobs they hold.
            exact = 0 < n_named <= len(tokens) and blob_id == prefix_key(
                tokens, self._block_tokens, self._fp, n_tokens=n_named
            )
            known = tokens[:n_named] if exact else None
            self._best_effort(
                self._forget, self._fp, name, known, self._block_tokens, marker_dir + name
            )
            return None
        header, blob_tokens = link.header, link.tokens
        common = common_prefix_len(blob_tokens, tokens)
        usable = self.usable(common, len(blob_tokens), len(tokens) - 1, breaks, header.breaks)
        if usable < 1:
            return None
        chain = [link]
        if header.base is not None:  # a delta: read every base before composing
            try:
                chain = resolve(self._store, self._fp, link)
            except BrokenChain as broken:
                logger.warning("prefix cache: removing delta %s: %s", key, broken)
                for bad, bad_tokens in broken.remove:
                    self._best_effort(
                        self._forget, self._fp, bad, bad_tokens, self._block_tokens, None
                    )
                return None
        state = link.payload if header.base is None else self._composer.compose(chain)
        self._best_effort(self._record_chain_use, chain)
        return CacheHit(usable, state, len(blob_tokens), blob_id)

    def usable(
        self,
        common: int,
        blob_tokens: int,
        limit: int,
        breaks: Collection[int] = (),
        stored_breaks: Collection[int] = (),
    ) -> int:
        return restorable_tokens(
            common,
            blob_tokens,
            limit,
            self._block_tokens,
            self._truncatable,
            breaks,
            stored_breaks,
            self.granule,
            self.shape_free,
        )

    def _best_effort(self, write: Callable[..., object], *args: object) -> None:
        """Bookkeeping and repairs during a lookup: a cache directory that cannot be written
        (read-only, immutable, full) still serves every hit it can read. Logged at the first
        failure and then at every 1,000th, not at each hit."""
        try:
            write(*args)
        except OSError as exc:
            with self._lock:
                self._write_failures += 1
                failures = self._write_failures
            if failures % 1000 == 1:
                logger.warning(
                    "prefix cache: cannot write to the cache (%s; %d times so far); "
                    "hits are still served",
                    exc,
                    failures,
                )

    def _record_chain_use(self, chain: list[Link]) -> None:
        """A hit on a delta uses its bases too. Each base is touched a moment after the blob
        standing on it, so least-recently-used order evicts a delta before its base."""
        now_s = self._clock()
        for depth, link in enumerate(chain):
            later_s = now_s + depth * _BASE_LATER_S
            self._record_use(blob_key(self._fp, link.name), link.name, later_s)

    def _record_use(self, key: str, name: str, now_s: float | None = None) -> None:
        self._store.touch(key, self._clock() if now_s is None else now_s)
        count = self._hit_count(self._fp, name)
        if count < HIT_COUNT_CAP:
            # Concurrent hits may both write count+1 and count once: harmless.
            self._store.put(hits_key(self._fp, name), bytes(count + 1), durable=False)

    def _hit_count(self, fp: str, name: str) -> int:
        stat = self._store.stat(hits_key(fp, name))
        return 0 if stat is None else stat.size_bytes

    # ---- save -------------------------------------------------------------

    def save(
        self, tokens_prefix: Sequence[int], state: bytes | memoryview, breaks: Sequence[int] = ()
    ) -> bool:
        """Store ``state`` for ``tokens_prefix``; True if it is cached afterwards.

        ``breaks``: where the prefill that computed it ended chunks inside it besides the block
        grid (a state is restorable only for prompts with the same ones: `restorable_tokens`).
        Never raises: storage failures (disk full, read-only, NFS errors) are
        logged as warnings and skip caching.
        """
        if len(breaks) > MAX_BREAKS:
            logger.info("prefix cache: a state with %d breaks is not saved", len(breaks))
            return False
        try:
            return self._save(list(tokens_prefix), state, tuple(breaks))
        except OSError as exc:
            logger.warning("prefix cache: save skipped: %s", exc)
        except Exception:  # background thread: a cache bug must not kill the job
            logger.warning("prefix cache: save failed", exc_info=True)
        return False

    def _save(self, tokens: list[int], view: bytes | memoryview, breaks: tuple[int, ...]) -> bool:
        if not tokens or not len(view):
            return False
        chain = block_hashes(tokens, self._block_tokens, self._fp)
        bounds = boundaries(tokens, self._block_tokens, self._fp, chain=chain)
        name = blob_name(len(tokens), prefix_key(tokens, self._block_tokens, self._fp, chain=chain))
        key = blob_key(self._fp, name)
        now_s = self._clock()
        top_marker = index_dir(self._fp, bounds[-1].key) + name
        if self._store.stat(key) is not None and self._store.stat(top_marker) is not None:
            self._store.touch(key, now_s)  # dedupe: already stored and indexed
            return True
        state = bytes(view)  # only now: a state stored already costs no copy of tens of MB
        delta = self._plan_delta(tokens, state, chain, bounds, name)
        if delta is None:
            blob = encode_blob(self._fp, self._block_tokens, tokens, state, breaks)
        else:
            blob = encode_blob(
                self._fp, self._block_tokens, tokens, delta.payload, breaks, delta.ref()
            )
        if len(blob) > self._max_bytes:
            logger.warning("prefix cache: %d-byte state exceeds max_bytes, not cached", len(blob))
            return False
        bases = [] if delta is None else [link.name for link in delta.chain]
        self._make_room(len(blob), keep=frozenset(bases))
        self._store.put(key, blob)  # blob before markers: a marker implies a blob
        self._store.touch(key, now_s)
        for depth, base in enumerate(bases, start=1):  # used now, and later than the new blob
            self._store.touch(blob_key(self._fp, base), now_s + depth * _BASE_LATER_S)
        for boundary in bounds:
            self._store.put(index_dir(self._fp, boundary.key) + name, b"", durable=False)
        self.count(bytes_written=len(blob))
        if self._truncatable and delta is None:  # a delta duplicates no stored cells
            self._drop_redundant(tokens, breaks, chain, bounds)
        return True

    def _plan_delta(
        self, tokens: list[int], state: bytes, chain: list[str], bounds: list[Boundary], name: str
    ) -> Plan | None:
        """The delta to store instead of the whole state, if a stored blob shares enough of its
        leading cells. Only for plain attention: a sliding-window state keeps the last window's
        cells, so a longer one does not extend a shorter one (its layout would not parse
        either: two caches)."""
        if not (self._deltas and self._truncatable):
            return None
        candidates: list[str] = []
        enough, upper = 0, len(tokens)
        for boundary in reversed(bounds):
            if upper <= MIN_SHARED_CELLS:
                break  # blobs first listed here share fewer tokens than `upper`
            upper = boundary.n_tokens
            found = self._delta_candidates(tokens, chain, boundary, {name, *candidates})
            enough = enough or (boundary.n_tokens if found else 0)
            candidates += found[: self._max_probes - len(candidates)]
            if len(candidates) >= self._max_probes:
                break
        if not candidates:
            return None
        return plan_delta(self._store, self._fp, tokens, state, candidates, enough=enough)

    def _delta_candidates(
        self, tokens: list[int], chain: list[str], boundary: Boundary, skip: set[str]
    ) -> list[str]:
        """Blobs at one boundary, best first: stored prefixes of `tokens`, then the longest.
        Deeper boundaries are asked first: their blobs share more tokens (at least the
        boundary's); shallower ones only when a deeper one has too few (their cells may
        differ: computed in other chunks)."""
        names = [
            n
            for n in self._store.list(index_dir(self._fp, boundary.key))
            if n not in skip and parse_name(n) is not None
        ]
        return sorted(names, key=lambda n: self._candidate_rank(n, tokens, chain))

    def _candidate_rank(self, name: str, tokens: list[int], chain: list[str]) -> tuple[bool, int]:
        n, blob_id = parse_name(name) or (0, "")
        exact = n < len(tokens) and blob_id == prefix_key(
            tokens, self._block_tokens, self._fp, n_tokens=n, chain=chain
        )
        return not exact, -n

    def _drop_redundant(
        self, tokens: list[int], breaks: tuple[int, ...], chain: list[str], bounds: list[Boundary]
    ) -> None:
        """Delete stored strict prefixes of ``tokens``: the new blob serves them, where both
        were computed without breaks before the shorter one's end.

        Protected (hot) ones stay, since their smaller state restores faster.
        Each candidate is examined once, in the directory of its last boundary.
        """
        for i, boundary in enumerate(bounds):
            next_len = bounds[i + 1].n_tokens if i + 1 < len(bounds) else len(tokens)
            for marker in self._store.list(index_dir(self._fp, boundary.key)):
                if not boundary.n_tokens <= name_tokens(marker) < next_len:
                    continue  # shallow boundaries list every entry: filter cheaply first
                parsed = parse_name(marker)
                if parsed is None:
                    continue
                n, blob_id = parsed
                if blob_id != prefix_key(
                    tokens, self._block_tokens, self._fp, n_tokens=n, chain=chain
                ):
                    continue
                # One ending mid-block still serves its exact repeat in full; the new blob
                # would serve it only cut back to the block boundary.
                if n % self._block_tokens or any(b < n for b in breaks):
                    continue
                head = self._read_head(self._fp, marker)
                if head is None or head[0].breaks:
                    continue
                if self._hit_count(self._fp, marker) < self._hot_hits:
                    self._forget(self._fp, marker, tokens[:n], self._block_tokens, None)

    # ---- removal and budget ----------------------------------------------

    def _forget(
        self,
        fp: str,
        name: str,
        blob_tokens: Sequence[int] | None,
        block_tokens: int,
        via_marker: str | None,
    ) -> bool:
        """Delete a blob, then its markers (all if tokens are known, else the one seen).

        Markers left behind point at a missing blob and are removed lazily by
        lookups or by verify(). Returns whether the blob file existed.
        """
        existed = self._store.delete(blob_key(fp, name))
        if blob_tokens is not None:
            for boundary in boundaries(blob_tokens, block_tokens, fp):
                self._store.delete(index_dir(fp, boundary.key) + name)
        if via_marker is not None:
            self._store.delete(via_marker)
        self._store.delete(hits_key(fp, name))
        return existed

    def _evict(self, entry: Stored) -> None:
        key = blob_key(entry.fp, entry.name)
        head = self._store.get_head(key, HEADER.size)
        block_tokens = HEADER.unpack(head)[3] if head and len(head) == HEADER.size else 0
        blob_tokens = self._read_tokens(entry.fp, entry.name) if block_tokens > 0 else None
        if self._forget(entry.fp, entry.name, blob_tokens, max(block_tokens, 1), None):
            self.count(evictions=1)

    def _make_room(self, incoming_bytes: int, keep: frozenset[str] = frozenset()) -> int:
        """Evict until the store plus ``incoming_bytes`` fits; return bytes freed.

        Usage is recomputed from the store each time (files are the source of
        truth); concurrent savers may overshoot by one blob each, briefly. ``keep``: this
        fingerprint's blobs the incoming one stands on.
        """
        fps = fingerprints(self._store)
        usage = sum(b.size_bytes for fp in fps for b in self._store.scan(f"{fp}/blobs/"))
        if usage + incoming_bytes <= self._max_bytes:
            return 0
        entries = scan(self._store, fps)  # hit counts are only needed when evicting
        usage = sum(e.size_bytes for e in entries)
        freed = 0
        for entry in eviction_order(entries, self._max_bytes, self._hot_hits):
            if usage + incoming_bytes <= self._max_bytes:
                break
            if entry.fp == self._fp and entry.name in keep:
                continue
            self._evict(entry)
            usage -= entry.size_bytes
            freed += entry.size_bytes
        return freed

    # ---- maintenance ------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self._fp

    def namespaced(self, namespace: str) -> PrefixCache:
        """The same store, budget and counters, under a separate namespace no other one reads."""
        cache = PrefixCache(
            self._store,
            f"{self._fp}-{namespace}",
            self._block_tokens,
            self._max_bytes,
            self._truncatable,
            clock=self._clock,
            hot_hits=self._hot_hits,
            max_probes=self._max_probes,
            deltas=self._deltas,
        )
        # Counted with this cache's: the model's figures, whoever's prompts they were.
        cache._lock, cache._counters = self._lock, self._counters
        cache.granule, cache.shape_free = self.granule, self.shape_free
        return cache

    def counters(self) -> dict[str, int]:
        """This process's hit/miss/byte counters (cheap: no directory scan)."""
        with self._lock:
            return dict(self._counters)

    def stats(self) -> CacheStats:
        mine = scan(self._store, [self._fp])
        everything = scan(self._store, fingerprints(self._store), with_hits=False)
        store_bytes = sum(e.size_bytes for e in everything)
        with self._lock:
            c = dict(self._counters)
        return CacheStats(
            entries=len(mine),
            bytes=sum(e.size_bytes for e in mine),
            max_bytes=self._max_bytes,
            hits=c["hits"],
            misses=c["misses"],
            hit_tokens=c["hit_tokens"],
            bytes_read=c["bytes_read"],
            bytes_written=c["bytes_written"],
            evictions=c["evictions"],
            store_bytes=store_bytes,
        )

    def entries(self) -> list[EntryInfo]:
        """This fingerprint's blobs, most recently used first."""
        mine = sorted(scan(self._store, [self._fp]), key=lambda e: e.last_used_s, reverse=True)
        return [
            EntryInfo(e.name.rsplit("-", 1)[1], e.n_tokens, e.size_bytes, e.last_used_s, e.hits)
            for e in mine
        ]

    def verify(self) -> VerifyReport:
        """Read every blob of this fingerprint, delete bad ones and stale markers."""
        return verify_blobs(self._store, self._fp, self._block_tokens, self._forget)

    def prune(self) -> int:
        """Enforce the budget now; return bytes freed."""
        try:
            return self._make_room(0)
        except OSError as exc:
            logger.warning("prefix cache prune failed: %s", exc)
            return 0

    def clear(self) -> int:
        """Delete every file of this fingerprint; return blobs removed."""
        removed = 0
        for entry in self._store.scan(f"{self._fp}/"):
            deleted = self._store.delete(entry.key)
            removed += int(deleted and entry.key.startswith(f"{self._fp}/blobs/"))
        return removed


def open_cache(settings: Settings, *, truncatable: bool = True) -> PrefixCache:
    """The configured model's cache in the configured directory.

    `truncatable` matters only to a process that restores states (a worker knows it from the
    loaded model); the API and CLI only read statistics and manage files.
    """
    return PrefixCache(
        DirectoryBlobStore(settings.cache_dir),
        cache_fingerprint(settings),
        block_tokens=settings.cache.block_tokens,
        max_bytes=settings.cache.max_bytes,
        truncatable=truncatable,
        deltas=settings.cache.deltas,
    )
