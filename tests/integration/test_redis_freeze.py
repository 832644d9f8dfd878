"""Redis frozen (SIGSTOP: connections stay open, nothing answers) under a running API, worker and
warmer, for longer than the worker's heartbeat TTL, then thawed: every route answers within the
API's deadline meanwhile, nothing is lost, and nothing runs twice though every running job's
claim lapsed meanwhile; a registry cleanup the freeze stalls takes no running job for abandoned
at the thaw."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
from rq import Retry
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry

from shared.queues import INTERACTIVE, queue
from shared.redis_outage import RedisWaiter
from shared.redis_server import connect
from shared.settings import RoutingSettings, WorkerSettings
from tests.harness import HTTP, Stack
from tests.integration.test_redis_outage import log_lines, wait_finished
from tests.integration.test_stream_load import COUNTING, Heard, listen, submit, wait_streaming
from tests.redis_process import RedisProcess
from worker.worker import ConclaveWorker

DEADLINE_S = 1.0
HEARTBEAT_TTL_S = 3  # the smallest the settings allow
# Past two TTLs: by the thaw every running job's claim has lapsed, whatever the beats' phase.
FREEZE_S = 2 * HEARTBEAT_TTL_S
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
# A route's answer: its status, its Retry-After, and how long it took.
Answer = tuple[int, str | None, float]


async def timed(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> Answer:
    started = time.monotonic()
    response = await client.request(method, url, **kwargs)
    return response.status_code, response.headers.get("Retry-After"), time.monotonic() - started


async def every_route(url: str, job_id: str) -> dict[str, Answer]:
    """Each route once, all at once."""
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            timed(client, "POST", f"{url}/v1/jobs", json={"prompt": "Hi"}),
            timed(client, "GET", f"{url}/v1/jobs/{job_id}"),
            timed(client, "GET", f"{url}/v1/jobs/{job_id}/events"),
            timed(client, "POST", f"{url}/v1/chat/completions", json=CHAT),
            timed(client, "GET", f"{url}/metrics"),
            timed(client, "GET", f"{url}/readyz"),
            timed(client, "GET", f"{url}/healthz"),
        )
    names = ["submit", "get", "events", "chat", "metrics", "readyz", "healthz"]
    return dict(zip(names, answers, strict=True))


async def through_a_freeze(
    stack: Stack, server: RedisProcess, job_id: str
) -> tuple[dict[str, Answer], Heard, float]:
    """A listener open when Redis freezes; every route asked while it is frozen. Returns when
    it froze (`time.monotonic`), too."""
    got_token = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"{stack.url}/v1/jobs/{job_id}/events"
        stream = asyncio.create_task(listen(client, url, got_token=got_token))
        await asyncio.wait_for(got_token.wait(), 30)
        server.freeze()
        frozen_at = time.monotonic()
        routes = await every_route(stack.url, job_id)
        heard = await asyncio.wait_for(stream, 30)  # ends with its error event while frozen
        return routes, heard, frozen_at


def test_a_frozen_redis_gets_fast_503s_and_loses_nothing(
    outage_redis: RedisProcess, stack_factory: Callable[..., Stack]
) -> None:
    stack = stack_factory(
        redis_url=outage_redis.url,
        api={"redis_timeout_s": DEADLINE_S},
        worker={"heartbeat_ttl_s": HEARTBEAT_TTL_S},
        warmer={"schedule": "*/3 * * * * *"},
    )
    stack.start_warmer()
    running = submit(stack, prompt=COUNTING, max_tokens=80, temperature=0)
    wait_streaming(stack, running)
    submitted = submit(stack, prompt=COUNTING, max_tokens=20, temperature=0)  # before the freeze
    before = {name: len(log_lines(stack, name)) for name in stack.procs}
    pids = {name: proc.pid for name, proc in stack.procs.items()}

    try:
        routes, heard, frozen_at = asyncio.run(through_a_freeze(stack, outage_redis, running))
        time.sleep(max(0.0, frozen_at + FREEZE_S - time.monotonic()))  # the freeze's length
        during = {name: log_lines(stack, name)[before[name] :] for name in stack.procs}
        frozen_s = time.monotonic() - frozen_at
    finally:
        outage_redis.thaw()
    thawed_at = time.time()

    for name, (status, retry_after, took) in routes.items():
        assert took <= DEADLINE_S + 1, (name, took)
        if name == "healthz":
            assert status == 200
        else:
            assert (status, retry_after) == (503, "2"), (name, status, retry_after)
    assert heard.cut is None, heard.cut
    assert heard.last == "error", heard.events[-3:]

    # After the thaw: both jobs finish, each run once, and the stream resumes whole.
    jobs = wait_finished(stack, [running, submitted])
    assert [job["status"] for job in jobs] == ["finished", "finished"]
    # Started once each (the start script counts every start of a job, resumed ones too).
    assert [job["attempts"] for job in jobs] == [1, 1]
    last_id = next(event_id for _, event_id, _ in reversed(heard.events) if event_id)
    resumed = asyncio.run(resume(f"{stack.url}/v1/jobs/{running}/events", last_id))
    assert resumed.last == "done", resumed.events[-3:]
    completion_tokens = jobs[0]["usage"]["completion_tokens"]  # type: ignore[index]
    assert heard.token_indices + resumed.token_indices == list(range(completion_tokens))
    text = [
        orjson.loads(data)["text"]
        for listened in (heard, resumed)
        for event, _, data in listened.events
        if event == "token"
    ]
    assert "".join(text) == jobs[0]["result"]["text"]  # type: ignore[index]

    # The outage logged once per interval, no traceback, then or after.
    assert sum(len(new) for new in during.values()) / frozen_s <= 5, during
    logged = {name: log_lines(stack, name)[before[name] :] for name in stack.procs}
    assert not any("Traceback" in line for new in logged.values() for line in new), logged
    # No job taken for abandoned and run again beside itself.
    worker_log = "\n".join(logged["worker-1"])
    assert "abandoned" not in worker_log and "carries on" not in worker_log, worker_log
    assert {name: proc.pid for name, proc in stack.procs.items() if proc.poll() is None} == pids
    deadline = time.monotonic() + 30
    while not any(
        run["started_at"] > thawed_at for run in HTTP.get(f"{stack.url}/v1/warm/runs").json()
    ):
        assert time.monotonic() < deadline, "no warm run after the thaw"
        time.sleep(0.5)


async def resume(url: str, last_event_id: str) -> Heard:
    async with httpx.AsyncClient(timeout=60) as client:
        return await listen(client, url, last_event_id)


# The job below runs until the test lets it end.
_release = threading.Event()


def hold() -> None:
    _release.wait(120)


@contextmanager
def worker_running_a_job(server: RedisProcess) -> Iterator[tuple[ConclaveWorker, Job]]:
    """A real Conclave worker without a model, as `granary worker` makes it, running `hold`
    (rq runs it on a thread of this process, heart-beating, retried once if abandoned)."""
    client = connect(server.url)
    settings = WorkerSettings(heartbeat_ttl_s=HEARTBEAT_TTL_S, maintenance_interval_s=1)
    waiter = RedisWaiter(client, logging.getLogger(__name__))
    worker = ConclaveWorker(
        client,
        settings,
        RoutingSettings(),
        waiter,
        lambda: 4,
        lambda: frozenset(),
        threading.Event(),
        lambda: None,  # forget: no model, nothing held
    )
    worker.register_birth()  # type: ignore[no-untyped-call]  # as rq's work loop does first
    queue(client, INTERACTIVE).enqueue(f"{__name__}.hold", retry=Retry(max=1))
    _release.clear()
    taken = worker.dequeue_job_and_maintain_ttl(1, 1)  # starts its routing round too
    assert taken is not None
    worker.execute_job(*taken)
    try:
        yield worker, taken[0]
    finally:
        _release.set()
        worker.teardown()
        client.close()


def clean_until_it_judges(worker: ConclaveWorker) -> None:
    """Maintenance as the work loop runs it, until it has judged the started registry (the
    worker waits for unbroken contact with Redis first)."""
    cleaned = worker.last_cleaned_at
    deadline = time.monotonic() + 30
    while worker.last_cleaned_at == cleaned:
        assert time.monotonic() < deadline, "the registry cleanup never ran"
        worker.run_maintenance_tasks()
        time.sleep(0.1)


def still_running(worker: ConclaveWorker, job: Job) -> bool:
    """rq's own records: the job claimed in its started registry, not queued again, started."""
    registry = StartedJobRegistry(INTERACTIVE, connection=worker.connection)
    queued = queue(worker.connection, INTERACTIVE).count
    job.refresh()
    claimed = job.id in registry.get_job_ids(cleanup=False)
    return claimed and queued == 0 and job.get_status() == JobStatus.STARTED


def test_a_cleanup_stalled_by_a_freeze_past_the_ttl_takes_no_running_job_for_abandoned(
    outage_redis: RedisProcess,
) -> None:
    """The maintenance starts while Redis is frozen and goes on at the thaw, when every claim
    has lapsed (before, it re-queued the running job, every time: rq judged by its clock)."""
    with worker_running_a_job(outage_redis) as (worker, job):
        clean_until_it_judges(worker)  # it does judge, unfrozen
        assert still_running(worker, job)

        outage_redis.freeze()
        try:
            maintenance = threading.Thread(target=worker.run_maintenance_tasks)
            maintenance.start()  # its first call waits for the thaw
            time.sleep(FREEZE_S)  # the freeze's length
        finally:
            outage_redis.thaw()
        maintenance.join(timeout=30)
        assert not maintenance.is_alive()
        assert still_running(worker, job)

        clean_until_it_judges(worker)  # once contact is back for a TTL: the beats landed since
        assert still_running(worker, job)
