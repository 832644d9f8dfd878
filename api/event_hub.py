"""One Redis pub/sub connection per API process, fanned out to every live listener.

The hub subscribes once, to the pattern of every job's channel, and hands each message to the
listeners of its job (a message nobody listens to costs a dictionary lookup). Listeners never
use the pub/sub connection themselves: one task owns it, since redis-py does not guard one
connection against two coroutines (re)connecting or reading it at once, as a listener
subscribing during the reader's reconnect could. Clients arriving together share one read of
the job's backlog too: a thousand clients reconnecting at once cost a few reads, not a
thousand (parsing them was most of the API's CPU in `make soak`).

What is published while that connection is broken never reaches it. So when it breaks, and
again once redis-py has reconnected and subscribed again, every listener is told; once the feed
is back it reads its job's backlog again from where it was: a blip costs a client nothing. If
the feed is not back within RECOVERY_S (Redis is down), `job_events` raises
`redis.ConnectionError`, the client's stream ends with an error event, and it resumes with
`Last-Event-ID`; the hub reconnects by itself with backoff, logging the outage once per
interval.

A frozen Redis (a stopped process, a stalled host, a partition that drops packets) breaks no
connection: it only stops answering, which on a pub/sub connection looks like a quiet feed. So
the reader pings Redis on that connection whenever the feed has been quiet for QUIET_S; a ping
unanswered within the API's Redis deadline counts as a broken feed, handled as above. Each
backlog read ends within the same deadline, its wait for a turn included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from shared import keys
from shared.job_store import JobEvent
from shared.log_limit import RateLimitedLog
from shared.redis_outage import REDIS_DOWN, Backoff, describe

log = logging.getLogger(__name__)

# A listener's live events, batch by batch; None when the live feed broke or came back.
Feed = asyncio.Queue[list[JobEvent] | None]
# Every job's channel (keys.job_channel).
JOB_CHANNELS = keys.job_channel("*")
# How long a listener whose feed broke waits for it to come back before its stream ends: past
# the reader's first reconnect attempts (0.1, 0.2, 0.4, 0.8 s), well short of a client's patience.
RECOVERY_S = 3.0
# How long the reader waits for a message at a time, and how long the feed may be quiet before
# it asks Redis whether it is still there.
POLL_S = 1.0
QUIET_S = 1.0


class EventHub:
    def __init__(self, redis: Redis, backlog_reads: int, deadline_s: float) -> None:
        self._redis = redis
        self._deadline_s = deadline_s
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        self._listeners: dict[str, set[Feed]] = defaultdict(set)
        # Backlog reads take turns rather than a pool connection each at once: hundreds of
        # clients reconnecting together would otherwise wait out the pool's timeout.
        self._backlog_turns = asyncio.Semaphore(backlog_reads)
        # Per job: the read waiting for its turn, which listeners arriving meanwhile share.
        self._waiting_reads: dict[str, asyncio.Future[list[JobEvent]]] = {}
        self._subscribed = False
        self._feed_up = asyncio.Event()  # subscribed, no read failed since
        self._outage = RateLimitedLog(log)
        self._reader: asyncio.Task[None] | None = None
        # When the feed last delivered anything (a message, a pong), and when the ping it has
        # not yet answered was sent: loop time.
        self._heard_at = 0.0
        self._ping_sent_at: float | None = None

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

    @contextlib.contextmanager
    def _listen(self, channel: str) -> Iterator[Feed]:
        """A queue receiving the events of each message published on `channel`."""
        feed: Feed = asyncio.Queue()
        self._listeners[channel].add(feed)
        try:
            yield feed
        finally:
            listeners = self._listeners[channel]
            listeners.discard(feed)
            if not listeners:
                del self._listeners[channel]

    async def job_events(self, job_id: str, after: int = -1) -> AsyncIterator[list[JobEvent]]:
        """A job's events past `after`, in batches, each once, up to and including the final one.

        The stored backlog comes first, then live ones. Listening before reading the backlog
        means no event can fall between the two; duplicates are dropped by sequence number.
        """
        with self._listen(keys.job_channel(job_id)) as live:
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
                if received is None:  # the feed broke or came back: it missed events
                    await self._feed_back()
                    received = await self._backlog(job_id)
                batch = received

    async def _feed_back(self) -> None:
        try:
            await asyncio.wait_for(self._feed_up.wait(), RECOVERY_S)
        except TimeoutError:
            raise redis.ConnectionError("the live event feed (Redis) is down") from None

    async def _backlog(self, job_id: str) -> list[JobEvent]:
        """The job's stored events, read after the caller began listening: callers arriving
        while a read waits for its turn share it, since it is sent after all of them listen."""
        read = self._waiting_reads.get(job_id)
        if read is None:
            read = asyncio.ensure_future(self._read_backlog(job_id))
            self._waiting_reads[job_id] = read
        return await asyncio.shield(read)

    async def _read_backlog(self, job_id: str) -> list[JobEvent]:
        this = asyncio.current_task()
        try:
            async with self._deadline("reading a job's events"), self._backlog_turns:
                # Sent from here on: who listens from now on may be too late for it, and reads anew.
                if self._waiting_reads.get(job_id) is this:
                    del self._waiting_reads[job_id]
                entries = await self._redis.xrange(keys.job_events(job_id)) or []
        finally:
            if self._waiting_reads.get(job_id) is this:
                del self._waiting_reads[job_id]
        return [JobEvent.from_fields(fields or {}) for _, fields in entries]

    @contextlib.asynccontextmanager
    async def _deadline(self, what: str) -> AsyncIterator[None]:
        """Ends the block within the deadline, raising what a Redis client raises on a timeout
        (callers map that to a 503 or a stream's `error` event)."""
        try:
            async with asyncio.timeout(self._deadline_s):
                yield
        except TimeoutError:
            raise redis.TimeoutError(f"{what}: no answer within {self._deadline_s:g} s") from None

    def _reconnected(self, _connection: AbstractConnection) -> None:
        # redis-py calls this after its own callback has subscribed again. A ping sent on the
        # connection before is never answered now.
        self._ping_sent_at = None
        self._feed_up.set()
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
                self._feed_up.clear()
                self._interrupt_all()
                if isinstance(exc, REDIS_DOWN):
                    self._outage.failure("event feed lost (%s); reconnecting", describe(exc))
                else:
                    self._outage.failure("event feed read failed; reconnecting", exc_info=exc)
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self._feed_up.set()  # also when redis-py reconnected inside a read that then failed
            self._outage.recovered("event feed reconnected")
            if message is not None and message["type"] == "pmessage":
                self._dispatch(message)

    async def _next_message(self) -> dict[str, Any] | None:
        if not self._subscribed:
            await self._pubsub.psubscribe(JOB_CHANNELS)
            assert self._pubsub.connection is not None
            self._pubsub.connection.register_connect_callback(self._reconnected)
            self._subscribed = True
            self._feed_up.set()
            self._interrupt_all()  # listeners that came first read their backlog again
        message: dict[str, Any] | None = await self._pubsub.get_message(timeout=POLL_S)
        now = asyncio.get_running_loop().time()
        if message is not None:
            self._heard_at, self._ping_sent_at = now, None
        elif self._ping_sent_at is None and now - self._heard_at >= QUIET_S:
            await self._pubsub.ping()  # answered on the feed, by a message of type "pong"
            self._ping_sent_at = now
        elif self._ping_sent_at is not None and now - self._ping_sent_at > self._deadline_s:
            await self._drop_connection()
            raise redis.TimeoutError(f"no answer to a ping within {self._deadline_s:g} s")
        return message

    async def _drop_connection(self) -> None:
        """Closes the pub/sub connection without waiting on its peer: the next read connects
        again and subscribes again (a frozen server would otherwise keep the silent one)."""
        self._ping_sent_at = None
        connection = self._pubsub.connection
        if connection is not None:
            with contextlib.suppress(*REDIS_DOWN, OSError):
                await connection.disconnect(nowait=True)

    def _dispatch(self, message: dict[str, Any]) -> None:
        feeds = self._listeners.get(message["channel"].decode())
        if not feeds:
            return
        events = JobEvent.from_message(message["data"])
        for feed in feeds:
            feed.put_nowait(events)
