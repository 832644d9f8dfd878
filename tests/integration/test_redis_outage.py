"""Redis stopped for some seconds and started again on the same port (append-only file on), under
a running API, worker and warmer: they ride it out."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import httpx
import redis

from tests.harness import HTTP, Stack
from tests.integration.test_stream_load import COUNTING, Heard, listen, submit, wait_streaming
from tests.redis_process import RedisProcess

OUTAGE_S = 6
# uvicorn's access log writes a line per request: the client's rate, not a flood of errors.
ACCESS_LINE = re.compile(r'"(GET|POST|DELETE) \S+ HTTP/1\.1" \d{3}')


def log_lines(stack: Stack, name: str) -> list[str]:
    return [line for line in stack.log(name).splitlines() if not ACCESS_LINE.search(line)]


def wait_finished(
    stack: Stack, job_ids: list[str], timeout_s: float = 240
) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [HTTP.get(f"{stack.url}/v1/jobs/{job_id}").json() for job_id in job_ids]
        if all(job["status"] not in ("queued", "started") for job in jobs):
            return jobs
        assert time.monotonic() < deadline, [job["status"] for job in jobs]
        time.sleep(0.2)


def test_a_redis_outage_is_ridden_out(
    outage_redis: RedisProcess, stack_factory: Callable[..., Stack]
) -> None:
    stack = stack_factory(redis_url=outage_redis.url, warmer={"schedule": "*/3 * * * * *"})
    stack.start_warmer()
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    # One job running when Redis goes away, three queued behind it.
    jobs = [submit(stack, prompt=COUNTING, max_tokens=80, temperature=0)]
    jobs += [submit(stack, prompt=COUNTING, max_tokens=20, temperature=0) for _ in range(3)]
    wait_streaming(stack, jobs[0])
    before = {name: len(log_lines(stack, name)) for name in stack.procs}

    outage_redis.stop()
    down_at = time.monotonic()
    during = []
    while time.monotonic() - down_at < OUTAGE_S:
        late = HTTP.post(f"{stack.url}/v1/jobs", json={"prompt": "Hi"}, timeout=10)
        read = HTTP.get(f"{stack.url}/v1/jobs/{jobs[1]}", timeout=10)
        ready = HTTP.get(f"{stack.url}/readyz", timeout=10)
        alive = HTTP.get(f"{stack.url}/healthz", timeout=10)
        during.append((late.status_code, read.status_code, ready.status_code, alive.status_code))
        time.sleep(0.5)
    logged = {name: log_lines(stack, name)[before[name] :] for name in stack.procs}
    outage_s = time.monotonic() - down_at
    outage_redis.start()
    up_at = time.time()

    assert set(during) == {(503, 503, 503, 200)}, during
    lines = sum(len(new) for new in logged.values())
    assert lines / outage_s <= 5, logged
    assert not any("Traceback" in line for new in logged.values() for line in new), logged

    # The API recovers by itself; every job queued before the outage finishes after it.
    deadline = time.monotonic() + 30
    while HTTP.get(f"{stack.url}/v1/jobs/{jobs[1]}", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the API did not recover"
        time.sleep(0.2)
    assert submit(stack, prompt="Hi", max_tokens=2)
    finished = wait_finished(stack, jobs)
    assert [job["status"] for job in finished] == ["finished"] * 4
    # The job running through the outage streamed every token: none lost while Redis was away.
    heard = asyncio.run(replay(f"{stack.url}/v1/jobs/{jobs[0]}/events"))
    completion_tokens = finished[0]["usage"]["completion_tokens"]  # type: ignore[index]
    assert heard.token_indices == list(range(completion_tokens))

    # Same processes: no exit, no model reload; the worker still registered, the warmer on time.
    assert {name: proc.pid for name, proc in stack.procs.items() if proc.poll() is None} == pids
    assert stack.log("worker-1").count("model smollm2-135m loaded") == 1
    assert HTTP.get(f"{stack.url}/readyz").status_code == 200
    deadline = time.monotonic() + 30
    while not any(
        run["started_at"] > up_at for run in HTTP.get(f"{stack.url}/v1/warm/runs").json()
    ):
        assert time.monotonic() < deadline, "no warm run after the outage"
        time.sleep(0.5)


async def replay(url: str) -> Heard:
    async with httpx.AsyncClient(timeout=60) as client:
        return await listen(client, url)


def test_a_worker_registers_again_when_redis_lost_its_registration(stack: Stack) -> None:
    # What a Redis restarted without its data (or an outage longer than the registration's
    # expiry) leaves: no trace of the worker, which must not then look dead to /readyz.
    assert HTTP.get(f"{stack.url}/readyz").status_code == 200
    redis.Redis.from_url(stack.settings.redis_url).flushdb()
    assert HTTP.get(f"{stack.url}/readyz").status_code == 503
    deadline = time.monotonic() + 30
    while HTTP.get(f"{stack.url}/readyz").status_code != 200:
        assert time.monotonic() < deadline, "the worker never registered again"
        time.sleep(0.2)
    assert submit(stack, prompt="Hi", max_tokens=2)
    assert stack.procs["worker-1"].poll() is None
