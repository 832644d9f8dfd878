"""Shared cache of KV-cache states keyed by token prefix.

Layout inside a :class:`~shared.blob_store.BlobStore` (``sh`` = first two hex
chars of ``bkey``, to keep the index fan-out small)::

    {fp}/blobs/{n}-{id}               one blob per saved prefix (header+tokens+state)
    {fp}/hits/{n}-{id}                its size in bytes is the hit count (capped at 16)
    {fp}/index/{sh}/{bkey}/{n}-{id}   empty marker: blob shares boundary bkey

``fp`` is the model fingerprint, ``n`` the blob's token count, ``id`` its
prefix key and ``bkey`` a boundary key (see shared.prefix_keys). A blob has a
marker at every boundary <= n: each full block plus power-of-two lengths below
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

import hashlib
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.blob_store import BlobEntry, BlobStore, DirectoryBlobStore
from shared.fingerprint import model_fingerprint
from shared.models import resolve_model
from shared.prefix_keys import (
    KEY_HEX_CHARS,
    Boundary,
    block_hashes,
    boundaries,
    common_prefix_len,
    prefix_key,
    token_bytes,
    tokens_digest,
    tokens_from_bytes,
)

logger = logging.getLogger(__name__)

MAGIC = b"GRNYKV\r\n"  # \r\n: a text-mode copy that mangles newlines fails fast
FORMAT_VERSION = 1
# magic, version, fingerprint length, block_tokens, n_tokens, payload length,
# sha256(tokens), blake2b-256(payload). Every byte of a blob is covered by a
# check: header fields by size/digest consistency, fingerprint by comparison.
_HEADER = struct.Struct("<8sHHIIQ32s32s")
HOT_HITS = 2
HIT_COUNT_CAP = 16
MAX_PROBES = 4
PROTECTED_FRACTION = 0.8

if TYPE_CHECKING:
    from shared.settings import Settings

_FINGERPRINT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_NAME = re.compile(rf"(\d+)-([0-9a-f]{{{KEY_HEX_CHARS}}})")


@dataclass(frozen=True, slots=True)
class CacheHit:
    n_tokens: int  # restore the state, then keep only this many tokens
    state: bytes
    blob_tokens: int  # tokens the state actually holds (>= n_tokens)
    key: str


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


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int
    ok: int
    removed: int
    bytes_removed: int
    orphans_removed: int  # index / hit markers whose blob no longer exists


@dataclass(frozen=True, slots=True)
class _Header:
    fingerprint: str
    block_tokens: int
    n_tokens: int
    payload_bytes: int
    tokens_sha256: bytes
    payload_digest: bytes

    @property
    def tokens_offset(self) -> int:
        return _HEADER.size + len(self.fingerprint.encode("utf-8"))

    @property
    def payload_offset(self) -> int:
        return self.tokens_offset + 4 * self.n_tokens


@dataclass(frozen=True, slots=True)
class _Stored:
    fp: str
    name: str
    n_tokens: int
    size_bytes: int
    last_used_s: float
    hits: int


def _payload_digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def encode_blob(fingerprint: str, block_tokens: int, tokens: Sequence[int], state: bytes) -> bytes:
    fp = fingerprint.encode("utf-8")
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        len(fp),
        block_tokens,
        len(tokens),
        len(state),
        tokens_digest(tokens),
        _payload_digest(state),
    )
    return b"".join((header, fp, token_bytes(tokens), state))


def _parse_head(data: bytes, expected_fp: str) -> tuple[_Header, list[int]] | None:
    """Header and verified tokens, or None if anything is inconsistent."""
    if len(data) < _HEADER.size:
        return None
    magic, version, fp_len, block_tokens, n, payload_bytes, tok_sha, pay_dig = _HEADER.unpack_from(
        data
    )
    if magic != MAGIC or version != FORMAT_VERSION or block_tokens < 1:
        return None
    fp = data[_HEADER.size : _HEADER.size + fp_len]
    if fp != expected_fp.encode("utf-8"):
        return None
    header = _Header(expected_fp, block_tokens, n, payload_bytes, tok_sha, pay_dig)
    raw_tokens = data[header.tokens_offset : header.payload_offset]
    if len(raw_tokens) != 4 * n or hashlib.sha256(raw_tokens).digest() != tok_sha:
        return None
    return header, tokens_from_bytes(raw_tokens)


def decode_blob(data: bytes, expected_fp: str) -> tuple[_Header, list[int], bytes] | None:
    """Fully verified (header, tokens, state) or None."""
    parsed = _parse_head(data, expected_fp)
    if parsed is None:
        return None
    header, tokens = parsed
    if len(data) != header.payload_offset + header.payload_bytes:
        return None  # truncated or trailing garbage
    payload = memoryview(data)[header.payload_offset :]
    if _payload_digest(payload) != header.payload_digest:
        return None
    return header, tokens, bytes(payload)


def _name_tokens(name: str) -> int:
    """Token count from a blob name without full validation (-1 if none): cheap filter."""
    n_text = name.partition("-")[0]
    return int(n_text) if n_text.isdigit() else -1


def _parse_name(name: str) -> tuple[int, str] | None:
    m = _NAME.fullmatch(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def _blob_name(n_tokens: int, blob_id: str) -> str:
    return f"{n_tokens}-{blob_id}"


# Per-process counters; workers sum them in Redis (shared.cache_counters).
COUNTER_NAMES = ("hits", "misses", "hit_tokens", "bytes_read", "bytes_written", "evictions")


def restorable_tokens(
    common: int,
    stored: int,
    limit: int,
    block_tokens: int,
    truncatable: bool,
    breaks: Collection[int] = (),
    stored_breaks: Collection[int] = (),
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
    """
    n = min(common, limit, stored)
    ours = {b for b in breaks if b < n}
    theirs = {b for b in stored_breaks if b < n}
    # After a chunk end only one side had, cells were computed in differently shaped batches.
    n = min([n, *(ours ^ theirs)])
    if n == stored and (n == limit or n % block_tokens == 0 or n in breaks):
        return n
    if not truncatable:
        return 0
    both = {b for b in breaks if b in stored_breaks and b <= n}
    return max([n - n % block_tokens, *both])


class PrefixCache:
    """Longest-prefix KV-state cache over a shared :class:`BlobStore`.

    Eviction (SLRU-style, why: a hot system-prompt prefix is small and hit by
    many jobs, while one-off conversation states are large and used once;
    plain LRU would let a burst of one-offs flush the hot prefix): entries
    hit >= ``hot_hits`` times form a protected segment capped at 80 % of the
    budget; everything else (plus protected overflow, least recent first) is
    evicted first, oldest last-use (file mtime, set via touch on every hit so
    it works across NFS hosts) first. The budget applies to the whole store,
    all fingerprints included, because the disk is what is shared.
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
    ) -> None:
        if not _FINGERPRINT.fullmatch(fingerprint):
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
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)

    # ---- key layout -------------------------------------------------------

    @staticmethod
    def _blob_key(fp: str, name: str) -> str:
        return f"{fp}/blobs/{name}"

    @staticmethod
    def _index_dir(fp: str, boundary_key: str) -> str:
        return f"{fp}/index/{boundary_key[:2]}/{boundary_key}/"

    @staticmethod
    def _hits_key(fp: str, name: str) -> str:
        return f"{fp}/hits/{name}"

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    # ---- lookup -----------------------------------------------------------

    def lookup(
        self, prompt_tokens: Sequence[int], min_tokens: int = 1, breaks: Collection[int] = ()
    ) -> CacheHit | None:
        """Longest usable cached prefix of at least `min_tokens`; never raises for bad files.

        `min_tokens` lets a caller that already holds a prefix in memory skip reading blobs
        that could not beat it; `breaks` are the prompt's extra chunk ends (see
        `restorable_tokens`).
        """
        tokens = list(prompt_tokens)
        hit: CacheHit | None = None
        if len(tokens) >= 2:  # the last prompt token is always decoded fresh
            try:
                hit = self._find(tokens, min_tokens, frozenset(breaks))
            except OSError as exc:
                logger.warning("prefix cache lookup failed, treating as miss: %s", exc)
        if hit is None:
            self._count(misses=1)
        else:
            self._count(hits=1, hit_tokens=hit.n_tokens, bytes_read=len(hit.state))
        return hit

    def _find(self, tokens: list[int], min_tokens: int, breaks: frozenset[int]) -> CacheHit | None:
        chain = block_hashes(tokens, self._block_tokens, self._fp)
        # A blob found at a boundary is shorter than the next longer boundary (else it would
        # have been found there), so once that bound drops below min_tokens, stop.
        upper = len(tokens) - 1
        for boundary in reversed(boundaries(tokens, self._block_tokens, self._fp, chain=chain)):
            if upper < min_tokens:
                return None
            upper = boundary.n_tokens
            marker_dir = self._index_dir(self._fp, boundary.key)
            names = self._store.list(marker_dir)
            if names:
                hit = self._best_at(tokens, chain, marker_dir, names, min_tokens, breaks)
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
    ) -> CacheHit | None:
        """Try the candidates sharing one boundary with the prompt, best first."""
        limit = len(tokens) - 1
        ranked: list[tuple[int, str]] = []  # (usable tokens, blob name)
        unknown: list[tuple[int, str]] = []  # (upper bound, blob name)
        for name in names:
            parsed = _parse_name(name)
            if parsed is None:
                self._store.delete(marker_dir + name)  # junk in the index
                continue
            n, blob_id = parsed
            if n <= len(tokens) and blob_id == prefix_key(
                tokens, self._block_tokens, self._fp, n_tokens=n, chain=chain
            ):
                usable = self.usable(n, n, limit, breaks)
                if usable > 0:
                    ranked.append((usable, name))
            elif self._truncatable:
                unknown.append((min(n, limit), name))
        if self._truncatable:
            ranked += self._probe(tokens, marker_dir, unknown, ranked, breaks)
        for usable, name in sorted(ranked, reverse=True):
            if usable < min_tokens:
                break
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
            blob_tokens = self._read_tokens(self._fp, name)
            if blob_tokens is None:
                self._forget(self._fp, name, None, self._block_tokens, marker_dir + name)
                continue
            common = common_prefix_len(blob_tokens, tokens)
            usable = self.usable(common, len(blob_tokens), len(tokens) - 1, breaks)
            if usable > 0:
                out.append((usable, name))
        return out

    def _read_tokens(self, fp: str, name: str) -> list[int] | None:
        parsed = _parse_name(name)
        if parsed is None:
            return None
        n = parsed[0]
        head_bytes = _HEADER.size + len(fp.encode("utf-8")) + 4 * n
        data = self._store.get_head(self._blob_key(fp, name), head_bytes)
        result = None if data is None else _parse_head(data, fp)
        if result is None or result[0].n_tokens != n:
            return None
        return result[1]

    def _load(
        self, tokens: list[int], marker_dir: str, name: str, breaks: frozenset[int]
    ) -> CacheHit | None:
        """Read and fully verify one blob; remove it if it is bad."""
        n, blob_id = _parse_name(name) or (-1, "")
        key = self._blob_key(self._fp, name)
        data = self._store.get(key)
        decoded = None if data is None else decode_blob(data, self._fp)
        if decoded is not None and (
            decoded[0].n_tokens != n
            or decoded[0].block_tokens != self._block_tokens
            or prefix_key(decoded[1], self._block_tokens, self._fp) != blob_id
        ):
            decoded = None  # intact file under the wrong name
        if decoded is None:
            if data is not None:
                logger.warning("prefix cache: removing corrupt blob %s", key)
            self._forget(self._fp, name, None, self._block_tokens, marker_dir + name)
            return None
        _, blob_tokens, state = decoded
        common = common_prefix_len(blob_tokens, tokens)
        usable = self.usable(common, len(blob_tokens), len(tokens) - 1, breaks)
        if usable < 1:
            return None
        self._record_use(key, name)
        return CacheHit(usable, state, len(blob_tokens), blob_id)

    def usable(
        self, common: int, blob_tokens: int, limit: int, breaks: Collection[int] = ()
    ) -> int:
        return restorable_tokens(
            common, blob_tokens, limit, self._block_tokens, self._truncatable, breaks
        )

    def _record_use(self, key: str, name: str) -> None:
        self._store.touch(key, self._clock())
        count = self._hit_count(self._fp, name)
        if count < HIT_COUNT_CAP:
            # Concurrent hits may both write count+1 and count once: harmless.
            self._store.put(self._hits_key(self._fp, name), bytes(count + 1), durable=False)

    def _hit_count(self, fp: str, name: str) -> int:
        stat = self._store.stat(self._hits_key(fp, name))
        return 0 if stat is None else stat.size_bytes

    # ---- save -------------------------------------------------------------

    def save(self, tokens_prefix: Sequence[int], state: bytes) -> bool:
        """Store ``state`` for ``tokens_prefix``; True if it is cached afterwards.

        Never raises: storage failures (disk full, read-only, NFS errors) are
        logged as warnings and skip caching.
        """
        try:
            return self._save(list(tokens_prefix), bytes(state))
        except OSError as exc:
            logger.warning("prefix cache: save skipped: %s", exc)
        except Exception:  # background thread: a cache bug must not kill the job
            logger.warning("prefix cache: save failed", exc_info=True)
        return False

    def _save(self, tokens: list[int], state: bytes) -> bool:
        if not tokens or not state:
            return False
        chain = block_hashes(tokens, self._block_tokens, self._fp)
        bounds = boundaries(tokens, self._block_tokens, self._fp, chain=chain)
        name = _blob_name(
            len(tokens), prefix_key(tokens, self._block_tokens, self._fp, chain=chain)
        )
        key = self._blob_key(self._fp, name)
        now_s = self._clock()
        top_marker = self._index_dir(self._fp, bounds[-1].key) + name
        if self._store.stat(key) is not None and self._store.stat(top_marker) is not None:
            self._store.touch(key, now_s)  # dedupe: already stored and indexed
            return True
        blob = encode_blob(self._fp, self._block_tokens, tokens, state)
        if len(blob) > self._max_bytes:
            logger.warning("prefix cache: %d-byte state exceeds max_bytes, not cached", len(blob))
            return False
        self._make_room(len(blob))
        self._store.put(key, blob)  # blob before markers: a marker implies a blob
        self._store.touch(key, now_s)
        for boundary in bounds:
            self._store.put(self._index_dir(self._fp, boundary.key) + name, b"", durable=False)
        self._count(bytes_written=len(blob))
        if self._truncatable:
            self._drop_redundant(tokens, chain, bounds)
        return True

    def _drop_redundant(self, tokens: list[int], chain: list[str], bounds: list[Boundary]) -> None:
        """Delete stored strict prefixes of ``tokens``: the new blob serves them.

        Protected (hot) ones stay, since their smaller state restores faster.
        Each candidate is examined once, in the directory of its last boundary.
        """
        for i, boundary in enumerate(bounds):
            next_len = bounds[i + 1].n_tokens if i + 1 < len(bounds) else len(tokens)
            for marker in self._store.list(self._index_dir(self._fp, boundary.key)):
                if not boundary.n_tokens <= _name_tokens(marker) < next_len:
                    continue  # shallow boundaries list every entry: filter cheaply first
                parsed = _parse_name(marker)
                if parsed is None:
                    continue
                n, blob_id = parsed
                if blob_id != prefix_key(
                    tokens, self._block_tokens, self._fp, n_tokens=n, chain=chain
                ):
                    continue
                # One ending mid-block still serves its exact repeat in full; the new blob
                # would serve it only cut back to the block boundary.
                if n % self._block_tokens:
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
        existed = self._store.delete(self._blob_key(fp, name))
        if blob_tokens is not None:
            for boundary in boundaries(blob_tokens, block_tokens, fp):
                self._store.delete(self._index_dir(fp, boundary.key) + name)
        if via_marker is not None:
            self._store.delete(via_marker)
        self._store.delete(self._hits_key(fp, name))
        return existed

    def _evict(self, entry: _Stored) -> None:
        key = self._blob_key(entry.fp, entry.name)
        head = self._store.get_head(key, _HEADER.size)
        block_tokens = _HEADER.unpack(head)[3] if head and len(head) == _HEADER.size else 0
        blob_tokens = self._read_tokens(entry.fp, entry.name) if block_tokens > 0 else None
        if self._forget(entry.fp, entry.name, blob_tokens, max(block_tokens, 1), None):
            self._count(evictions=1)

    def _fingerprints(self) -> list[str]:
        """Every namespace sharing the store (the budget is global)."""
        return [fp for fp in self._store.list("") if _FINGERPRINT.fullmatch(fp)]

    def _scan(self, fps: Iterable[str], *, with_hits: bool = True) -> list[_Stored]:
        out: list[_Stored] = []
        for fp in fps:
            hits = self._store.scan(f"{fp}/hits/") if with_hits else []
            hit_counts = {h.key.rsplit("/", 1)[-1]: h.size_bytes for h in hits}
            for blob in self._store.scan(f"{fp}/blobs/"):
                out.append(self._stored(fp, blob, hit_counts))
        return [s for s in out if s.n_tokens >= 0]

    @staticmethod
    def _stored(fp: str, blob: BlobEntry, hit_counts: dict[str, int]) -> _Stored:
        name = blob.key.rsplit("/", 1)[-1]
        parsed = _parse_name(name)
        n = -1 if parsed is None else parsed[0]  # -1: not ours, filtered out
        return _Stored(fp, name, n, blob.size_bytes, blob.mtime_s, hit_counts.get(name, 0))

    def _eviction_order(self, entries: list[_Stored]) -> list[_Stored]:
        by_recency = sorted(entries, key=lambda e: (e.last_used_s, e.name), reverse=True)
        protected_cap = PROTECTED_FRACTION * self._max_bytes
        protected: list[_Stored] = []
        probation: list[_Stored] = []
        protected_bytes = 0
        for e in by_recency:
            if e.hits >= self._hot_hits and protected_bytes + e.size_bytes <= protected_cap:
                protected.append(e)
                protected_bytes += e.size_bytes
            else:
                probation.append(e)
        return probation[::-1] + protected[::-1]  # least recently used first

    def _make_room(self, incoming_bytes: int) -> int:
        """Evict until the store plus ``incoming_bytes`` fits; return bytes freed.

        Usage is recomputed from the store each time (files are the source of
        truth); concurrent savers may overshoot by one blob each, briefly.
        """
        fps = self._fingerprints()
        usage = sum(b.size_bytes for fp in fps for b in self._store.scan(f"{fp}/blobs/"))
        if usage + incoming_bytes <= self._max_bytes:
            return 0
        entries = self._scan(fps)  # hit counts are only needed when evicting
        usage = sum(e.size_bytes for e in entries)
        freed = 0
        for entry in self._eviction_order(entries):
            if usage + incoming_bytes <= self._max_bytes:
                break
            self._evict(entry)
            usage -= entry.size_bytes
            freed += entry.size_bytes
        return freed

    # ---- maintenance ------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self._fp

    def namespaced(self, namespace: str) -> PrefixCache:
        """The same store and budget, under a separate namespace no other one reads."""
        return PrefixCache(
            self._store,
            f"{self._fp}-{namespace}",
            self._block_tokens,
            self._max_bytes,
            self._truncatable,
            clock=self._clock,
            hot_hits=self._hot_hits,
            max_probes=self._max_probes,
        )

    def counters(self) -> dict[str, int]:
        """This process's hit/miss/byte counters (cheap: no directory scan)."""
        with self._lock:
            return dict(self._counters)

    def stats(self) -> CacheStats:
        mine = self._scan([self._fp])
        everything = self._scan(self._fingerprints(), with_hits=False)
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
        mine = sorted(self._scan([self._fp]), key=lambda e: e.last_used_s, reverse=True)
        return [
            EntryInfo(e.name.rsplit("-", 1)[1], e.n_tokens, e.size_bytes, e.last_used_s, e.hits)
            for e in mine
        ]

    def verify(self) -> VerifyReport:
        """Read every blob of this fingerprint, delete bad ones and stale markers."""
        checked = removed = bytes_removed = 0
        for entry in self._scan([self._fp]):
            checked += 1
            if self._verify_one(entry.name):
                continue
            removed += 1
            bytes_removed += entry.size_bytes
        orphans = self._remove_orphans()
        return VerifyReport(checked, checked - removed, removed, bytes_removed, orphans)

    def _verify_one(self, name: str) -> bool:
        data = self._store.get(self._blob_key(self._fp, name))
        if data is None:
            return True  # deleted concurrently: nothing to judge
        decoded = decode_blob(data, self._fp)
        parsed = _parse_name(name)
        # The header's block size, not ours: a worker configured differently may
        # share this fingerprint, and its blobs are valid under its own keys.
        block_tokens = self._block_tokens if decoded is None else decoded[0].block_tokens
        if (
            decoded is not None
            and parsed is not None
            and decoded[0].n_tokens == parsed[0]
            and prefix_key(decoded[1], block_tokens, self._fp) == parsed[1]
        ):
            return True
        logger.warning("prefix cache verify: removing bad blob %s", name)
        tokens = decoded[1] if decoded is not None else None
        self._forget(self._fp, name, tokens, block_tokens, None)
        return False

    def _remove_orphans(self) -> int:
        removed = 0
        for area in ("index", "hits"):
            for marker in self._store.scan(f"{self._fp}/{area}/"):
                name = marker.key.rsplit("/", 1)[-1]
                if _parse_name(name) is not None and (
                    self._store.stat(self._blob_key(self._fp, name)) is not None
                ):
                    continue
                removed += int(self._store.delete(marker.key))
        return removed

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
    model_path = resolve_model(settings.model, settings.data_dir)
    return PrefixCache(
        DirectoryBlobStore(settings.cache_dir),
        model_fingerprint(model_path, settings.data_dir),
        block_tokens=settings.cache.block_tokens,
        max_bytes=settings.cache.max_bytes,
        truncatable=truncatable,
    )
