"""The API's event hub on a real Redis: a cut pub/sub connection costs a listener nothing; a
frozen Redis ends its streams within a bound, and the hub carries on once it thaws."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis

from api.event_hub import POLL_S, QUIET_S, RECOVERY_S, EventHub
from shared import keys
from shared.redis_server import deadline_kwargs
from tests.harness import free_port
from tests.redis_process import RedisProcess

DEADLINE_S = 1.0


def publish(client: redis.Redis, job_id: str, seq: int, event: str = "token") -> None:
    """What a worker's publisher does for one event: the stream for replay, the channel live."""
    client.xadd(keys.job_events(job_id), {"seq": seq, "event": event, "data": str(seq)})
    client.publish(keys.job_channel(job_id), f"{seq}|{event}|{seq}")


async def listen_through_a_cut(url: str) -> list[int]:
    client = redis.Redis.from_url(url)
    hub = EventHub(AsyncRedis.from_url(url), backlog_reads=2, deadline_s=DEADLINE_S)
    await hub.start()
    job_id = uuid.uuid4().hex
    heard: list[int] = []

    async def listen() -> None:
        async for batch in hub.job_events(job_id):
            heard.extend(e.seq for e in batch)

    listener = asyncio.create_task(listen())
    try:
        for seq in range(3):
            publish(client, job_id, seq)
        async with asyncio.timeout(30):
            while len(heard) < 3:  # live: the hub is subscribed
                await asyncio.sleep(0.01)
        # Redis stays up; only the hub's connection goes. What is published before it is back
        # reaches no subscriber: only the stream holds it.
        assert client.client_kill_filter(_type="pubsub") >= 1
        for seq in range(3, 6):
            publish(client, job_id, seq)
        publish(client, job_id, 6, "done")
        await asyncio.wait_for(listener, 30)
    finally:
        listener.cancel()
        await hub.stop()
        client.close()
    return heard


def test_a_listener_whose_feed_is_cut_reads_on_from_the_stream(redis_url: str) -> None:
    # Before, the listener's stream ended with an error and its client had to resume.
    assert asyncio.run(listen_through_a_cut(redis_url)) == list(range(7))


async def listen_through_a_freeze(server: RedisProcess) -> tuple[list[int], float, list[int]]:
    """A listener open when Redis freezes: what it heard and how long after the freeze its
    stream ended; after a thaw, once the live feed is back, what resuming from there hears."""
    client = redis.Redis.from_url(server.url)
    hub = EventHub(
        AsyncRedis.from_url(server.url, **deadline_kwargs(DEADLINE_S)),
        backlog_reads=2,
        deadline_s=DEADLINE_S,
    )
    await hub.start()
    job_id = uuid.uuid4().hex
    heard: list[int] = []

    async def listen(job_id: str, after: int, into: list[int]) -> None:
        async for batch in hub.job_events(job_id, after):
            into.extend(e.seq for e in batch)

    try:
        publish(client, job_id, 0)
        listener = asyncio.create_task(listen(job_id, -1, heard))
        async with asyncio.timeout(30):
            while not heard:
                await asyncio.sleep(0.01)
        server.freeze()
        frozen_at = time.monotonic()
        with pytest.raises(redis.RedisError):
            await asyncio.wait_for(listener, 30)
        ended_after = time.monotonic() - frozen_at
        server.thaw()
        await live_feed_is_back(hub, client)
        for seq in range(1, 3):
            publish(client, job_id, seq)
        publish(client, job_id, 3, "done")
        resumed: list[int] = []
        await asyncio.wait_for(listen(job_id, heard[-1], resumed), 30)
    finally:
        server.thaw()
        await hub.stop()
        client.close()
    return heard, ended_after, resumed


async def live_feed_is_back(hub: EventHub, client: redis.Redis) -> None:
    """Returns once an event only published (never stored) reaches a listener."""
    job_id = uuid.uuid4().hex
    live: list[int] = []

    async def listen() -> None:
        async for batch in hub.job_events(job_id):
            live.extend(e.seq for e in batch)

    listener = asyncio.create_task(listen())
    try:
        async with asyncio.timeout(30):
            seq = 0
            while not live:  # the listener may not be registered yet: publish until it hears
                client.publish(keys.job_channel(job_id), f"{seq}|token|{seq}")
                seq += 1
                await asyncio.sleep(0.1)
    finally:
        listener.cancel()


def test_a_listener_whose_redis_freezes_ends_within_a_bound_and_resumes_after(
    tmp_path: Path,
) -> None:
    # A frozen Redis breaks no connection: before, the feed only looked quiet, and the stream
    # stayed open and silent for as long as the freeze lasted.
    with RedisProcess(tmp_path / "redis", free_port()) as server:
        heard, ended_after, resumed = asyncio.run(listen_through_a_freeze(server))
    assert heard == [0]
    # Noticed at the latest a quiet spell, the deadline and a poll after the freeze; then the
    # listener waits its recovery time for the feed to come back.
    assert ended_after <= QUIET_S + DEADLINE_S + POLL_S + RECOVERY_S + 1, ended_after
    assert resumed == [1, 2, 3]
