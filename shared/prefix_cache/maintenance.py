"""`granary cache verify`: read every blob of a fingerprint, remove bad ones and stale markers.

Lookups verify what they read and repair as they go; this sweeps what no lookup reaches,
deltas whose base is gone or was replaced included.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.prefix_cache.blobs import BlobStore
from shared.prefix_cache.eviction import scan
from shared.prefix_cache.format import Header, blob_key, decode_blob, parse_name
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
    sound: dict[str, _Sound] = {}
    deltas: list[tuple[str, int, _Sound]] = []
    for entry in scan(store, [fp]):
        checked += 1
        intact, verdict = _verify_one(store, fp, entry.name, block_tokens, forget)
        if not intact:
            removed += 1
            bytes_removed += entry.size_bytes
        elif verdict is None:
            continue
        elif verdict.header.base is None:
            sound[entry.name] = verdict
        else:
            deltas.append((entry.name, entry.size_bytes, verdict))
    # Shallowest first: a delta is judged once its base has been.
    for name, size, delta in sorted(deltas, key=lambda d: d[2].header.depth):
        if _stands(delta, sound):
            sound[name] = delta
            continue
        logger.warning("prefix cache verify: removing delta %s: its base is gone or changed", name)
        forget(fp, name, list(delta.tokens), delta.header.block_tokens, None)
        removed += 1
        bytes_removed += size
    orphans = _remove_orphans(store, fp)
    return VerifyReport(checked, checked - removed, removed, bytes_removed, orphans)


@dataclass(frozen=True, slots=True)
class _Sound:
    """A blob that read back intact: what a delta's reference to it is checked against."""

    header: Header
    tokens: array[int]  # compact: verify holds every blob's tokens at once


def _stands(delta: _Sound, sound: dict[str, _Sound]) -> bool:
    ref = delta.header.base
    base = None if ref is None else sound.get(ref.name)
    return (
        ref is not None
        and base is not None
        and base.header.payload_digest == ref.payload_digest
        and base.header.depth < ref.depth
        and base.tokens[: ref.shared] == delta.tokens[: ref.shared]
    )


def _verify_one(
    store: BlobStore, fp: str, name: str, block_tokens: int, forget: Forget
) -> tuple[bool, _Sound | None]:
    """(False if it was removed, what it holds if it is still there)."""
    data = store.get(blob_key(fp, name))
    if data is None:
        return True, None  # deleted concurrently: nothing to judge
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
        return True, _Sound(decoded[0], array("i", decoded[1]))
    logger.warning("prefix cache verify: removing bad blob %s", name)
    tokens = decoded[1] if decoded is not None else None
    forget(fp, name, tokens, block_tokens, None)
    return False, None


def _remove_orphans(store: BlobStore, fp: str) -> int:
    removed = 0
    for area in ("index", "hits"):
        for marker in store.scan(f"{fp}/{area}/"):
            name = marker.key.rsplit("/", 1)[-1]
            if parse_name(name) is not None and store.stat(blob_key(fp, name)) is not None:
                continue
            removed += int(store.delete(marker.key))
    return removed
