"""Counters a worker keeps in memory, added to Redis after each job so the API sums every
worker's: the prefix cache's (hits, bytes written) and the model's work (milliseconds and rows
read by prompt chunks and decode steps). Only what changed since the last publish is added, so
a worker that restarts never counts anything twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from redis import Redis

# A Redis hash, and what the worker counts into it now (totals since it started).
Source = tuple[str, Callable[[], dict[str, int]]]


class CounterPublisher:
    def __init__(self, redis: Redis, sources: Sequence[Source]) -> None:
        self._redis = redis
        self._sources = list(sources)
        self._published: dict[str, dict[str, int]] = {key: {} for key, _ in sources}
        # Jobs end on threads of their own: two publishing at once would add one change twice.
        self._lock = threading.Lock()

    def publish(self) -> None:
        with self._lock, self._redis.pipeline(transaction=False) as pipe:
            totals = {key: read() for key, read in self._sources}
            for key, current in totals.items():
                before = self._published[key]
                for name, value in current.items():
                    if value != before.get(name, 0):
                        pipe.hincrby(key, name, value - before.get(name, 0))
            pipe.execute()
            self._published = totals
