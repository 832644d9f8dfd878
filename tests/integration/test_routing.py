"""Cache-aware routing (shared/routing.py) with two real worker processes, real Redis and SmolLM2.

The disk cache is off, so `cached_tokens` of a document's question comes from a worker's memory
alone; which worker ran a job is rq's record of it (`worker_name`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from shared import documents, keys, routing
from shared.prefix_usage import document_prefix_id
from shared.queues import INTERACTIVE
from shared.schemas import DocumentFields
from tests.harness import HTTP, Stack
from tests.integration.test_extraction import INSTRUCTIONS, INVOICE, QUESTIONS
from tests.integration.test_job_path import COUNTING, first_tokens, submit, wait_status

# Off: a question on any worker would restore the document from disk; memory is what routing
# is about.
NO_DISK = {"enabled": False}


def ask(stack: Stack, question: str, max_tokens: int = 8) -> dict[str, Any]:
    body = {
        "document": INVOICE,
        "instructions": INSTRUCTIONS,
        "prompt": question,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return submit(stack, body)


def finished(stack: Stack, job: dict[str, Any]) -> dict[str, Any]:
    view = wait_status(stack, job["id"], {"finished", "failed"}, timeout_s=120)
    assert view["status"] == "finished", view
    return view


def status(stack: Stack, job: dict[str, Any]) -> str:
    view: dict[str, Any] = HTTP.get(f"{stack.url}/v1/jobs/{job['id']}").json()
    return str(view["status"])


def worker_of(client: redis.Redis, job_id: str) -> str:
    name: bytes = client.hget(f"rq:job:{job_id}", "worker_name")  # type: ignore[assignment]
    return name.decode()


def prefix() -> str:
    """The id workers advertise: the document's, as the API normalised it."""
    sent = DocumentFields(document=INVOICE, instructions=INSTRUCTIONS)
    return document_prefix_id(documents.normalized(sent)[0], None)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def advertised(client: redis.Redis, holder: str) -> None:
    """Both workers advertise, and `holder` as the document's."""
    wait_until(lambda: client.get(keys.holder(prefix())) == holder.encode(), "the holder")
    wait_until(lambda: len(client.keys(keys.room("*"))) == 2, "both workers' room")


def process_of(stack: Stack, client: redis.Redis, worker: str) -> str:
    pid = int(client.hget(f"rq:worker:{worker}", "pid") or 0)
    return next(name for name, proc in stack.procs.items() if proc.pid == pid)


def test_a_documents_next_questions_run_on_the_worker_holding_it(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(workers=2, cache=NO_DISK)
    client = redis.Redis.from_url(stack.settings.redis_url)
    first = finished(stack, ask(stack, QUESTIONS[0]))
    assert first["usage"]["cached_tokens"] == 0
    holder = worker_of(client, first["id"])
    advertised(client, holder)
    for question in QUESTIONS[1:]:
        view = finished(stack, ask(stack, question))
        assert worker_of(client, view["id"]) == holder
        # Its document came from the holder's memory: only the question was prefilled.
        assert 0 < view["usage"]["prompt_tokens"] - view["usage"]["cached_tokens"] < 30
    body = {
        "document": INVOICE,
        "instructions": INSTRUCTIONS,
        "questions": [{"id": f"q{i}", "question": q} for i, q in enumerate(QUESTIONS)],
        "max_tokens": 8,
    }
    response = HTTP.post(f"{stack.url}/v1/extractions", json=body)
    assert response.status_code == 202, response.text
    extraction = finished(stack, response.json())
    assert worker_of(client, extraction["id"]) == holder
    assert extraction["usage"]["cached_tokens"] > 0


def test_with_its_holder_busy_a_question_runs_elsewhere_at_once(
    stack_factory: Callable[..., Stack],
) -> None:
    # One thread each: the holder decodes its two jobs while the second worker loads.
    stack = stack_factory(cache=NO_DISK, worker={"max_active_jobs": 2}, n_threads=1)
    client = redis.Redis.from_url(stack.settings.redis_url)
    holder = worker_of(client, finished(stack, ask(stack, QUESTIONS[0]))["id"])
    # As long as the context allows: on a fast host 400 tokens were over before the second
    # worker had loaded, and the holder had room again (CI's one failure).
    busy = [submit(stack, {**COUNTING, "max_tokens": 1000}) for _ in range(2)]
    for job in busy:
        first_tokens(stack, job["id"], 1)  # both of the holder's places are taken
    stack.start_worker("worker-2")
    advertised(client, holder)
    assert all(status(stack, job) == "started" for job in busy), "the holder had room again"
    view = finished(stack, ask(stack, QUESTIONS[1]))
    assert worker_of(client, view["id"]) != holder
    assert view["timings"]["queued_ms"] < stack.settings.routing.wait_s * 1000
    assert status(stack, busy[0]) == "started"
    for job in busy:
        HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")


def test_a_question_routed_to_a_holder_killed_meanwhile_runs_elsewhere_within_the_bound(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(workers=2, cache=NO_DISK)
    client = redis.Redis.from_url(stack.settings.redis_url)
    holder = worker_of(client, finished(stack, ask(stack, QUESTIONS[0]))["id"])
    advertised(client, holder)
    stack.kill(process_of(stack, client, holder))
    job = ask(stack, QUESTIONS[1])
    # Its affinity had not expired yet: the job went to the dead worker's list...
    private = routing.QUEUE_PREFIX + routing.private_queue(INTERACTIVE, holder)
    assert client.lrange(private, 0, -1) == [job["id"].encode()]
    # ...and another worker took it back within the wait (or when the affinity expired).
    view = finished(stack, job)
    assert worker_of(client, view["id"]) != holder
    bound_s = min(stack.settings.routing.wait_s, routing.ADVERTISE_TTL_S) + 2  # sweeps, a dequeue
    assert view["timings"]["queued_ms"] < bound_s * 1000
    assert client.llen(private) == 0
