"""Redis frozen (SIGSTOP: connections stay open, nothing answers) under a running API, worker and
warmer, then thawed: every route answers within the API's deadline meanwhile, nothing is lost,
and nothing runs twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from tests.harness import Stack
from tests.integration.test_redis_outage import log_lines, wait_finished
from tests.integration.test_stream_load import COUNTING, Heard, listen, submit, wait_streaming
from tests.redis_process import RedisProcess

DEADLINE_S = 1.0
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
) -> tuple[dict[str, Answer], Heard]:
    """A listener open when Redis freezes; every route asked while it is frozen."""
    got_token = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"{stack.url}/v1/jobs/{job_id}/events"
        stream = asyncio.create_task(listen(client, url, got_token=got_token))
        await asyncio.wait_for(got_token.wait(), 30)
        server.freeze()
        routes = await every_route(stack.url, job_id)
        heard = await asyncio.wait_for(stream, 30)  # ends with its error event while frozen
        return routes, heard


def test_a_frozen_redis_gets_fast_503s_and_loses_nothing(
    outage_redis: RedisProcess, stack_factory: Callable[..., Stack]
) -> None:
    stack = stack_factory(
        redis_url=outage_redis.url,
        api={"redis_timeout_s": DEADLINE_S},
        # Longer than the freeze (~6 s), as the default 30 s is longer than a stall: a freeze
        # past it is a dead worker to every other one, and still ran a job twice here about one
        # run in four (rightly resumed, its result whole) after the worker's own beat-before-
        # cleanup; the suite's 3 s would test that case, which is not solved.
        worker={"heartbeat_ttl_s": 15},
        warmer={"schedule": "*/3 * * * * *"},
    )
    stack.start_warmer()
    running = submit(stack, prompt=COUNTING, max_tokens=80, temperature=0)
    wait_streaming(stack, running)
    submitted = submit(stack, prompt=COUNTING, max_tokens=20, temperature=0)  # before the freeze
    before = {name: len(log_lines(stack, name)) for name in stack.procs}
    pids = {name: proc.pid for name, proc in stack.procs.items()}

    frozen_at = time.monotonic()
    try:
        routes, heard = asyncio.run(through_a_freeze(stack, outage_redis, running))
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
        run["started_at"] > thawed_at for run in httpx.get(f"{stack.url}/v1/warm/runs").json()
    ):
        assert time.monotonic() < deadline, "no warm run after the thaw"
        time.sleep(0.5)


async def resume(url: str, last_event_id: str) -> Heard:
    async with httpx.AsyncClient(timeout=60) as client:
        return await listen(client, url, last_event_id)
