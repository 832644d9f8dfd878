"""One Redis pub/sub connection per API process, fanned out to every live listener.

SSE clients of the same job share one subscription; a channel is subscribed while at least
one client listens and dropped when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from shared import keys
from shared.job_store import JobEvent

log = logging.getLogger(__name__)


class EventHub:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._listeners: dict[str, set[asyncio.Queue[list[JobEvent]]]] = defaultdict(set)
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._pubsub.subscribe(keys.api_hub())
        self._reader = asyncio.create_task(self._read(), name="event-hub")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._pubsub.aclose()

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[asyncio.Queue[list[JobEvent]]]:
        """A queue receiving the events of each message published on `channel`."""
        queue: asyncio.Queue[list[JobEvent]] = asyncio.Queue()
        first = not self._listeners[channel]
        self._listeners[channel].add(queue)
        try:
            if first:
                await self._pubsub.subscribe(channel)
            yield queue
        finally:
            listeners = self._listeners[channel]
            listeners.discard(queue)
            if not listeners:
                del self._listeners[channel]
                await self._pubsub.unsubscribe(channel)

    async def job_events(self, job_id: str, after: int = -1) -> AsyncIterator[list[JobEvent]]:
        """A job's events past `after`, in batches, each once, up to and including the final one.

        The stored backlog comes first, then live ones. Subscribing before reading the backlog
        means no event can fall between the two; duplicates are dropped by sequence number.
        """
        async with self.listen(keys.job_channel(job_id)) as live:
            entries = await self._redis.xrange(keys.job_events(job_id)) or []
            batch = [JobEvent.from_fields(fields or {}) for _, fields in entries]
            while True:
                fresh = [e for e in batch if e.seq > after or e.final]
                final = next((i for i, e in enumerate(fresh) if e.final), None)
                if final is not None:
                    yield fresh[: final + 1]
                    return
                if fresh:
                    yield fresh
                    after = fresh[-1].seq
                batch = await live.get()

    async def _read(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # a dropped connection: redis-py reconnects and resubscribes
                log.warning("pub/sub read failed; retrying", exc_info=True)
                await asyncio.sleep(0.5)
                continue
            if message is None or message["type"] != "message":
                continue
            channel = message["channel"].decode()
            events = JobEvent.from_message(message["data"])
            for queue in self._listeners.get(channel, ()):
                queue.put_nowait(events)
