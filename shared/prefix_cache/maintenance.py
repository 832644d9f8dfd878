"""`granary cache verify`: read every blob of a fingerprint, remove bad ones and stale markers.

Lookups verify what they read and repair as they go; this sweeps what no lookup reaches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.prefix_cache.blobs import BlobStore
from shared.prefix_cache.eviction import scan
from shared.prefix_cache.format import blob_key, decode_blob, parse_name
from shared.prefix_cache.keys import prefix_key

logger = logging.getLogger(__name__)

# Deletes a blob and its markers: (fingerprint, name, its tokens if known, block size, marker).
Forget = Callable[[str, str, Sequence[int] | None, int, str | None], bool]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int
    ok: int
    removed: int
    bytes_removed: int
    orphans_removed: int  # index / hit markers whose blob no longer exists


def verify_blobs(store: BlobStore, fp: str, block_tokens: int, forget: Forget) -> VerifyReport:
    checked = removed = bytes_removed = 0
    for entry in scan(store, [fp]):
        checked += 1
        if _verify_one(store, fp, entry.name, block_tokens, forget):
            continue
        removed += 1
        bytes_removed += entry.size_bytes
    orphans = _remove_orphans(store, fp)
    return VerifyReport(checked, checked - removed, removed, bytes_removed, orphans)


def _verify_one(store: BlobStore, fp: str, name: str, block_tokens: int, forget: Forget) -> bool:
    data = store.get(blob_key(fp, name))
    if data is None:
        return True  # deleted concurrently: nothing to judge
    decoded = decode_blob(data, fp)
    parsed = parse_name(name)
    # The header's block size, not ours: a worker configured differently may
    # share this fingerprint, and its blobs are valid under its own keys.
    if decoded is not None:
        block_tokens = decoded[0].block_tokens
    if (
        decoded is not None
        and parsed is not None
        and decoded[0].n_tokens == parsed[0]
        and prefix_key(decoded[1], block_tokens, fp) == parsed[1]
    ):
        return True
    logger.warning("prefix cache verify: removing bad blob %s", name)
    tokens = decoded[1] if decoded is not None else None
    forget(fp, name, tokens, block_tokens, None)
    return False


def _remove_orphans(store: BlobStore, fp: str) -> int:
    removed = 0
    for area in ("index", "hits"):
        for marker in store.scan(f"{fp}/{area}/"):
            name = marker.key.rsplit("/", 1)[-1]
            if parse_name(name) is not None and store.stat(blob_key(fp, name)) is not None:
                continue
            removed += int(store.delete(marker.key))
    return removed
