"""One Redis pub/sub connection per API process, fanned out to every live listener.

SSE clients of the same job share one subscription; a channel is subscribed while at least
one client listens and dropped when the last one leaves. Clients arriving together share one
read of the job's backlog too: a thousand clients reconnecting at once cost a few reads, not a
thousand (parsing them was most of the API's CPU in `make soak`).

What is published while that connection is broken never reaches it, so when it breaks (or
redis-py reconnects it behind the scenes) every listener is told: its `job_events` raises
`redis.ConnectionError`, its client resumes from the job's stream with `Last-Event-ID`, and
the hub reconnects by itself with backoff, logging the outage once per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import redis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from shared import keys
from shared.job_store import JobEvent
from shared.log_limit import RateLimitedLog
from shared.redis_outage import REDIS_DOWN, Backoff, describe

log = logging.getLogger(__name__)

# A listener's live events, batch by batch; None when the live feed broke.
Feed = asyncio.Queue[list[JobEvent] | None]


class EventHub:
    def __init__(self, redis: Redis, backlog_reads: int) -> None:
        self._redis = redis
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._listeners: dict[str, set[Feed]] = defaultdict(set)
        # Per channel: done once SUBSCRIBE is sent; every listener of the channel waits for it.
        self._subscriptions: dict[str, asyncio.Future[None]] = {}
        # Backlog reads take turns rather than a pool connection each at once: hundreds of
        # clients reconnecting together would otherwise wait out the pool's timeout.
        self._backlog_turns = asyncio.Semaphore(backlog_reads)
        # Per job: the read waiting for its turn, which listeners arriving meanwhile share.
        self._waiting_reads: dict[str, asyncio.Future[list[JobEvent]]] = {}
        self._hub_subscribed = False
        self._unsubscribe_later: set[str] = set()
        self._outage = RateLimitedLog(log)
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # The reader subscribes, so an API started while Redis is down serves (503s) and
        # catches up by itself.
        self._reader = asyncio.create_task(self._read(), name="event-hub")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        with contextlib.suppress(*REDIS_DOWN):
            await self._pubsub.aclose()

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[Feed]:
        """A queue receiving the events of each message published on `channel`."""
        feed: Feed = asyncio.Queue()
        self._listeners[channel].add(feed)
        try:
            subscribed = self._subscriptions.get(channel)
            if subscribed is None:
                subscribed = asyncio.ensure_future(self._subscribe(channel))
                self._subscriptions[channel] = subscribed
            await asyncio.shield(subscribed)
            yield feed
        finally:
            listeners = self._listeners[channel]
            listeners.discard(feed)
            if not listeners:
                del self._listeners[channel]
                del self._subscriptions[channel]
                await self._unsubscribe(channel)

    async def job_events(self, job_id: str, after: int = -1) -> AsyncIterator[list[JobEvent]]:
        """A job's events past `after`, in batches, each once, up to and including the final one.

        The stored backlog comes first, then live ones. Subscribing before reading the backlog
        means no event can fall between the two; duplicates are dropped by sequence number.
        """
        async with self.listen(keys.job_channel(job_id)) as live:
            _forget_breaks(live)
            batch = await self._backlog(job_id)
            while True:
                fresh = [e for e in batch if e.seq > after or e.final]
                final = next((i for i, e in enumerate(fresh) if e.final), None)
                if final is not None:
                    yield fresh[: final + 1]
                    return
                if fresh:
                    yield fresh
                    after = fresh[-1].seq
                received = await live.get()
                if received is None:
                    raise redis.ConnectionError("the live event feed (Redis) was interrupted")
                batch = received

    async def _backlog(self, job_id: str) -> list[JobEvent]:
        """The job's stored events, read after the caller subscribed: callers arriving while a
        read waits for its turn share it, since it is sent after all of them subscribed."""
        read = self._waiting_reads.get(job_id)
        if read is None:
            read = asyncio.ensure_future(self._read_backlog(job_id))
            self._waiting_reads[job_id] = read
        return await asyncio.shield(read)

    async def _read_backlog(self, job_id: str) -> list[JobEvent]:
        this = asyncio.current_task()
        try:
            async with self._backlog_turns:
                # Sent from here on: who subscribes now may be too late for it, and reads anew.
                if self._waiting_reads.get(job_id) is this:
                    del self._waiting_reads[job_id]
                entries = await self._redis.xrange(keys.job_events(job_id)) or []
        finally:
            if self._waiting_reads.get(job_id) is this:
                del self._waiting_reads[job_id]
        return [JobEvent.from_fields(fields or {}) for _, fields in entries]

    async def _subscribe(self, channel: str) -> None:
        await self._pubsub.subscribe(channel)
        # Runs on each reconnect of the pub/sub connection (the first connect is over by now).
        assert self._pubsub.connection is not None
        self._pubsub.connection.register_connect_callback(self._reconnected)

    async def _unsubscribe(self, channel: str) -> None:
        try:
            await self._pubsub.unsubscribe(channel)
        except REDIS_DOWN:
            # redis-py re-subscribes it on reconnect; the reader drops it then.
            self._unsubscribe_later.add(channel)

    def _reconnected(self, _connection: AbstractConnection) -> None:
        self._interrupt_all()

    def _interrupt_all(self) -> None:
        for feeds in self._listeners.values():
            for feed in feeds:
                feed.put_nowait(None)

    async def _read(self) -> None:
        backoff = Backoff()
        while True:
            try:
                message = await self._next_message()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._interrupt_all()
                if isinstance(exc, REDIS_DOWN):
                    self._outage.failure("event feed lost (%s); reconnecting", describe(exc))
                else:
                    self._outage.failure("event feed read failed; reconnecting", exc_info=exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self._outage.recovered("event feed reconnected")
            if message is not None and message["type"] == "message":
                self._dispatch(message)

    async def _next_message(self) -> dict[str, Any] | None:
        if not self._hub_subscribed:
            await self._subscribe(keys.api_hub())
            self._hub_subscribed = True
        stale = [c for c in self._unsubscribe_later if c not in self._listeners]
        if stale:
            await self._pubsub.unsubscribe(*stale)
            self._unsubscribe_later.difference_update(stale)
        message: dict[str, Any] | None = await self._pubsub.get_message(timeout=1.0)
        return message

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message["channel"].decode()
        events = JobEvent.from_message(message["data"])
        for feed in self._listeners.get(channel, ()):
            feed.put_nowait(events)


def _forget_breaks(feed: Feed) -> None:
    """Drop the breaks signalled before a listener reads its backlog: they cost it nothing.

    A reconnect signals after redis-py has re-subscribed (its callback runs first), and the
    backlog holds whatever was published before. A break not yet reconnected is signalled
    again by that reconnect, after the read, so it still ends the stream. Without this, a
    client resuming right after an outage would be told of the break its own subscribe healed.
    """
    kept = []
    while not feed.empty():
        item = feed.get_nowait()
        if item is not None:
            kept.append(item)
    for item in kept:
        feed.put_nowait(item)
