"""Job-state transitions against a real Redis (they are Lua scripts)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis

from shared import keys
from shared.errors import JobNotFound
from shared.job_store import JobStore
from shared.redis_outage import RedisWaiter
from shared.schemas import JobResult, JobStatus, RenderedPrompt, TokenEvent, WorkOrder
from worker.token_publisher import TokenPublisher

ORDER = WorkOrder(
    prompt=RenderedPrompt(text="hi", add_bos=True),
    prompt_tokens=1,
    max_tokens=4,
    temperature=0,
    top_p=1,
    seed=1,
    stop=[],
)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def store(client: redis.Redis) -> JobStore:
    return JobStore(client, result_ttl_s=60)


def test_retry_never_publishes_a_token_twice(store: JobStore) -> None:
    store.create("j", "interactive", ORDER)
    assert store.start("j") == 1
    store.emit("j", [TokenEvent(index=i, text=f"t{i}") for i in range(3)])
    assert store.start("j") == 2  # a second worker re-runs it
    store.emit("j", [TokenEvent(index=i, text=f"t{i}") for i in range(2)])
    store.emit("j", [TokenEvent(index=i, text=f"t{i}") for i in range(2, 5)])
    store.finish("j", JobStatus.FINISHED, result=JobResult(text="x", finish_reason="length"))
    events = store.events("j")
    assert [e.seq for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e.event for e in events][-1] == "done"


def test_cancel_beats_a_late_finish(store: JobStore) -> None:
    store.create("j", "interactive", ORDER)
    store.start("j")
    assert store.cancel("j").status == JobStatus.CANCELLED
    assert store.emit("j", [TokenEvent(index=0, text="a")]) is True  # the worker is told
    store.finish("j", JobStatus.FINISHED, result=JobResult(text="a", finish_reason="length"))
    view = store.get("j")
    assert view.status == JobStatus.CANCELLED
    assert view.result is not None  # the partial text is kept
    assert [e.event for e in store.events("j")] == ["token", "done"]


def test_cancelled_queued_job_does_not_start(store: JobStore) -> None:
    store.create("j", "interactive", ORDER)
    store.cancel("j")
    assert store.start("j") == 0
    assert [e.event for e in store.events("j")] == ["done"]


def test_finished_job_cannot_be_cancelled_or_refinished(store: JobStore) -> None:
    store.create("j", "interactive", ORDER)
    store.start("j")
    store.finish("j", JobStatus.FINISHED, result=JobResult(text="a", finish_reason="stop"))
    assert store.cancel("j").status == JobStatus.FINISHED
    assert store.finish("j", JobStatus.FAILED, error="late") is False
    assert store.get("j").status == JobStatus.FINISHED


def test_many_jobs_read_in_order_with_gone_ones_as_none(store: JobStore) -> None:
    for job_id in ("a", "b", "c"):
        store.create(job_id, "batch", ORDER)
    store.start("b")
    store.finish("b", JobStatus.FINISHED, result=JobResult(text="x", finish_reason="stop"))
    store.discard("c")
    views = store.get_many(["b", "missing", "a", "c"])
    assert [v.id if v else None for v in views] == ["b", None, "a", None]
    assert views[0] is not None and views[0].result == JobResult(text="x", finish_reason="stop")
    assert views[2] == store.get("a")


def test_a_job_whose_record_went_while_it_ran_stops_its_worker_and_reads_as_gone(
    store: JobStore, client: redis.Redis
) -> None:
    store.create("j", "interactive", ORDER)
    store.start("j")
    client.delete(keys.job("j"))  # expired, or deleted from outside
    assert store.emit("j", [TokenEvent(index=0, text="a")]) is True  # the worker stops
    assert not client.exists(keys.job("j"))  # and left no record without a status
    client.hset(keys.job("k"), "emitted", 3)  # what a worker before that check left behind
    for job_id in ("j", "k"):
        with pytest.raises(JobNotFound):
            store.get(job_id)
    assert store.get_many(["j", "k"]) == [None, None]


def test_a_publishers_end_publishes_at_once_without_waiting_out_its_interval(
    store: JobStore, client: redis.Redis
) -> None:
    """Events within the interval of a publish wait for the next one; the end does not."""
    store.create("j", "interactive", ORDER)
    store.start("j")
    waiter = RedisWaiter(client, logging.getLogger(__name__))
    publisher = TokenPublisher(store, "j", interval_s=30.0, waiter=waiter)
    with publisher:
        publisher.token(1, "a")
        while not store.events("j"):  # the first publish is out: the interval has begun
            time.sleep(0.01)
        publisher.token(2, "b")  # held for the interval
        closing = time.monotonic()
    assert time.monotonic() - closing < 10  # not the 30 s interval
    texts = [TokenEvent.model_validate_json(e.data).text for e in store.events("j")]
    assert texts == ["a", "b"]
