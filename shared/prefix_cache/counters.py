"""Prefix-cache counters of every worker, summed in Redis so the API and CLI can show them.

Workers count hits, misses and bytes in memory and add what changed after each job
(shared/counter_deltas.py); entries and bytes on disk are read from the cache directory itself,
which stays the source of truth.
"""

from __future__ import annotations

from redis import Redis

from shared import keys
from shared.prefix_cache.cache import COUNTERS, PrefixCache
from shared.schemas import CacheReport
from shared.settings import Settings


def read_counters(redis: Redis, fingerprint: str) -> dict[str, int]:
    raw: dict[bytes, bytes] = redis.hgetall(keys.cache_counters(fingerprint))  # type: ignore[assignment]
    return {k.decode(): int(v) for k, v in raw.items()}


def cache_report(settings: Settings, redis: Redis | None, cache: PrefixCache | None) -> CacheReport:
    """Disk figures from the directory, counters summed over every worker from Redis."""
    if cache is None:
        return CacheReport(enabled=False, dir=str(settings.cache_dir))
    stats = cache.stats()
    counters = read_counters(redis, cache.fingerprint) if redis is not None else cache.counters()
    return CacheReport(
        enabled=True,
        dir=str(settings.cache_dir),
        fingerprint=cache.fingerprint,
        entries=stats.entries,
        bytes=stats.bytes,
        max_bytes=stats.max_bytes,
        directory_bytes=stats.store_bytes,
        **{name: counters.get(name, 0) for name in COUNTERS},
    )
