"""The API's event hub on a real Redis: a cut pub/sub connection costs a listener nothing."""

from __future__ import annotations

import asyncio
import uuid

import redis
from redis.asyncio import Redis as AsyncRedis

from api.event_hub import EventHub
from shared import keys


def publish(client: redis.Redis, job_id: str, seq: int, event: str = "token") -> None:
    """What a worker's publisher does for one event: the stream for replay, the channel live."""
    client.xadd(keys.job_events(job_id), {"seq": seq, "event": event, "data": str(seq)})
    client.publish(keys.job_channel(job_id), f"{seq}|{event}|{seq}")


async def listen_through_a_cut(url: str) -> list[int]:
    client = redis.Redis.from_url(url)
    hub = EventHub(AsyncRedis.from_url(url), backlog_reads=2)
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
