"""What the budget evicts first: SLRU over every blob in the store, all fingerprints included.

Why SLRU: a hot system-prompt prefix is small and hit by many jobs, while one-off conversation
states are large and used once; plain LRU would let a burst of one-offs flush the hot prefix.
Entries hit >= ``hot_hits`` times form a protected segment capped at 80 % of the budget;
everything else (plus protected overflow, least recent first) is evicted first, oldest last
use (file mtime, touched on every hit so it works across NFS hosts) first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.prefix_cache.blobs import BlobEntry, BlobStore
from shared.prefix_cache.format import FINGERPRINT, parse_name

HOT_HITS = 2
PROTECTED_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class Stored:
    fp: str
    name: str
    n_tokens: int
    size_bytes: int
    last_used_s: float
    hits: int


def fingerprints(store: BlobStore) -> list[str]:
    """Every namespace sharing the store (the budget is global)."""
    return [fp for fp in store.list("") if FINGERPRINT.fullmatch(fp)]


def scan(store: BlobStore, fps: Iterable[str], *, with_hits: bool = True) -> list[Stored]:
    out: list[Stored] = []
    for fp in fps:
        hits = store.scan(f"{fp}/hits/") if with_hits else []
        hit_counts = {h.key.rsplit("/", 1)[-1]: h.size_bytes for h in hits}
        for blob in store.scan(f"{fp}/blobs/"):
            out.append(_stored(fp, blob, hit_counts))
    return [s for s in out if s.n_tokens >= 0]


def _stored(fp: str, blob: BlobEntry, hit_counts: dict[str, int]) -> Stored:
    name = blob.key.rsplit("/", 1)[-1]
    parsed = parse_name(name)
    n = -1 if parsed is None else parsed[0]  # -1: not ours, filtered out
    return Stored(fp, name, n, blob.size_bytes, blob.mtime_s, hit_counts.get(name, 0))


def eviction_order(entries: list[Stored], max_bytes: int, hot_hits: int) -> list[Stored]:
    """Entries in the order the budget evicts them."""
    by_recency = sorted(entries, key=lambda e: (e.last_used_s, e.name), reverse=True)
    protected_cap = PROTECTED_FRACTION * max_bytes
    protected: list[Stored] = []
    probation: list[Stored] = []
    protected_bytes = 0
    for e in by_recency:
        if e.hits >= hot_hits and protected_bytes + e.size_bytes <= protected_cap:
            protected.append(e)
            protected_bytes += e.size_bytes
        else:
            probation.append(e)
    return probation[::-1] + protected[::-1]  # least recently used first
