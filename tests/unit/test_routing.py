"""Routing's scripts against a real Redis (Lua, TIME and rq's own lists): where a job goes, and
how a routed job nobody took comes back. The worker's side runs a real `ConclaveWorker`
without a model (its room and memory are given)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from rq import Queue
from rq.job import Job

from shared import keys, routing
from shared.codec import JsonSerializer
from shared.queues import INTERACTIVE, QUEUES, RUN_JOB, enqueue, queue
from shared.redis_outage import RedisWaiter
from shared.settings import RoutingSettings, Settings, WorkerSettings
from worker.conclave.memory import Resident
from worker.worker import ConclaveWorker

PREFIX = "doc-1"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as connection:
        yield connection


def submit(client: redis.Redis, job_id: str, prefix: str = PREFIX) -> str | None:
    """As the API enqueues a job about a document; returns the worker it went to."""
    with client.pipeline() as pipe:
        enqueue(client, INTERACTIVE, RUN_JOB, job_id, Settings(), pipeline=pipe)
        routing.Routing(client).route(pipe, INTERACTIVE, job_id, prefix)
        owner = pipe.execute()[-1]
    return owner.decode() if owner else None


def advertise(client: redis.Redis, worker: str, room: int, held: tuple[str, ...] = ()) -> None:
    private = [routing.private_queue(INTERACTIVE, worker)]
    routing.Routing(client).advertise(worker, held, room, private)


def shared_ids(client: redis.Redis) -> list[str]:
    return queue(client, INTERACTIVE).get_job_ids()


def private_ids(client: redis.Redis, worker: str) -> list[str]:
    return queue(client, routing.private_queue(INTERACTIVE, worker)).get_job_ids()


def test_a_job_goes_to_the_live_worker_holding_its_document(client: redis.Redis) -> None:
    advertise(client, "a", room=2, held=(PREFIX,))
    advertise(client, "b", room=2)
    assert submit(client, "j1") == "a"
    assert private_ids(client, "a") == ["j1"]
    assert shared_ids(client) == []
    # rq's view of the job is the shared queue's: registries, retries and re-queues use it.
    job = Job.fetch("j1", connection=client, serializer=JsonSerializer)
    assert job.origin == INTERACTIVE
    assert client.get(keys.room("a")) == b"1"  # each routed job takes one place


def test_nothing_is_routed_to_a_worker_without_room_or_when_one_worker_is_alone(
    client: redis.Redis,
) -> None:
    advertise(client, "a", room=1, held=(PREFIX,))
    assert submit(client, "alone") is None  # one worker: exactly as without routing
    advertise(client, "b", room=1)
    assert submit(client, "first") == "a"
    assert submit(client, "full") is None  # a's one place is taken
    assert submit(client, "other", prefix="doc-2") is None  # nobody holds it
    assert shared_ids(client) == ["alone", "full", "other"]


def test_a_routed_job_nobody_took_in_time_goes_to_the_front_of_the_shared_queue(
    client: redis.Redis,
) -> None:
    advertise(client, "a", room=3, held=(PREFIX,))
    advertise(client, "b", room=3)
    submit(client, "old-1")
    submit(client, "old-2")
    enqueue(client, INTERACTIVE, RUN_JOB, "plain", Settings())
    time.sleep(0.3)
    submit(client, "new")
    sweeper = routing.Routing(client)
    assert sweeper.sweep(wait_s=0.2) == 2
    assert shared_ids(client) == ["old-1", "old-2", "plain"]
    assert private_ids(client, "a") == ["new"]
    assert sweeper.sweep(wait_s=0.2) == 0  # moved once, never twice


def test_a_job_its_worker_took_is_never_moved(client: redis.Redis) -> None:
    advertise(client, "a", room=3, held=(PREFIX,))
    advertise(client, "b", room=3)
    submit(client, "j1")
    assert client.lpop(routing.QUEUE_PREFIX + routing.private_queue(INTERACTIVE, "a")) == b"j1"
    assert routing.Routing(client).sweep(wait_s=0.0) == 0
    assert shared_ids(client) == []
    assert client.zcard(keys.routed()) == 0


def test_a_dead_workers_routed_jobs_go_back_before_the_wait_is_over(client: redis.Redis) -> None:
    advertise(client, "a", room=3, held=(PREFIX,))
    advertise(client, "b", room=3)
    submit(client, "j1")
    client.delete(keys.room("a"))  # what its advertisement expiring looks like
    assert routing.Routing(client).sweep(wait_s=60) == 1
    assert shared_ids(client) == ["j1"]


def test_a_cancelled_routed_job_leaves_its_private_list(client: redis.Redis) -> None:
    advertise(client, "a", room=3, held=(PREFIX,))
    advertise(client, "b", room=3)
    submit(client, "j1")
    submit(client, "j2")
    routing.unqueue(client, INTERACTIVE, "j1")
    assert private_ids(client, "a") == ["j2"]
    assert routing.waiting(client, INTERACTIVE) == 1


def test_a_stopping_worker_hands_its_jobs_back_in_order(client: redis.Redis) -> None:
    advertise(client, "a", room=3, held=(PREFIX,))
    advertise(client, "b", room=3)
    submit(client, "j1")
    submit(client, "j2")
    enqueue(client, INTERACTIVE, RUN_JOB, "plain", Settings())
    assert routing.Routing(client).withdraw("a", [INTERACTIVE]) == 2
    assert shared_ids(client) == ["j1", "j2", "plain"]
    assert client.get(keys.room("a")) is None
    assert submit(client, "later") is None  # nothing more goes to it


def test_room_counts_what_already_waits_in_the_private_list(client: redis.Redis) -> None:
    advertise(client, "a", room=2, held=(PREFIX,))
    advertise(client, "b", room=2)
    submit(client, "j1")
    advertise(client, "a", room=2, held=(PREFIX,))
    assert client.get(keys.room("a")) == b"1"
    assert routing.waiting(client, INTERACTIVE) == 1  # queue depth counts it


def conclave_worker(client: redis.Redis, name: str, held: frozenset[str]) -> ConclaveWorker:
    worker = ConclaveWorker(
        client,
        WorkerSettings(),
        RoutingSettings(),
        RedisWaiter(client, logging.getLogger("test")),
        free_sequences=lambda: 4,
        held_documents=lambda: held,
        held_changed=threading.Event(),
        forget=lambda: None,  # no model: nothing held to drop
        name=name,
    )
    worker.register_birth()  # type: ignore[no-untyped-call]  # as rq's work loop does first
    return worker


def test_a_conclave_worker_takes_its_routed_job_first_and_runs_it_as_the_shared_queues(
    client: redis.Redis,
) -> None:
    holder = conclave_worker(client, "holder", frozenset({PREFIX}))
    other = conclave_worker(client, "other", frozenset())
    holder._tick()
    other._tick()
    enqueue(client, INTERACTIVE, RUN_JOB, "earlier", Settings())
    assert submit(client, "routed") == "holder"
    # rq lists and reports the shared queues alone, as without routing.
    assert {q.name for q in Queue.all(connection=client)} == set(QUEUES)
    job, job_queue = holder.dequeue_job_and_maintain_ttl(1, 1) or (None, None)
    assert job is not None and job_queue is not None
    assert (job.id, job_queue.name) == ("routed", INTERACTIVE)
    assert client.zcard(keys.routed()) == 0
    holder._withdraw()  # stops its routing thread too


def test_a_conclave_worker_that_stops_hands_what_waits_for_it_back(client: redis.Redis) -> None:
    holder = conclave_worker(client, "holder", frozenset({PREFIX}))
    conclave_worker(client, "other", frozenset())._tick()
    holder._tick()
    assert [submit(client, j) for j in ("r1", "r2")] == ["holder", "holder"]
    holder._withdraw()
    assert shared_ids(client) == ["r1", "r2"]
    assert client.get(keys.room("holder")) is None
    holder._tick()  # a stopping worker advertises nothing more
    assert client.get(keys.room("holder")) is None


def test_memory_names_only_documents_it_holds_whole() -> None:
    resident = Resident(seq=0, namespace=None, tokens=list(range(50)), prefilled=50)
    resident.label(("short", 40))
    resident.label(("long", 60))  # not all of it is in the cells yet
    assert resident.documents == {"short": 40}
    resident.keep_documents(39)  # cut below the prefix
    assert resident.documents == {}
