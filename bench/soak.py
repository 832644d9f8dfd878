"""`make soak`: issue 15's targets for streams and Redis outages, on real processes.

1. 1,000 SSE listeners at once on a running job: how every stream ends (`done`, `error`, cut),
   the API's resident memory, and `/healthz` latency while they listen.
2. Redis stopped for 30 s under a running job, queued jobs, open streams and the warmer: worker
   and warmer restarts, log lines per second, what the API answers, whether the queued jobs
   finish afterwards, and whether the interrupted streams resume whole with `Last-Event-ID`.
3. A 50 MB request body: how fast it is refused (413) and what it costs the API in memory.

Loopback only: an API, one worker and the warmer as separate processes, and a private
redis-server (append-only file on, `appendfsync everysec`) on its own port. Writes docs/SOAK.md.

Usage: python -m bench.soak [--listeners 1000] [--outage-s 30] [--port-base PORT]
       python -m bench.soak listen URL N  (one listener process; Last-Event-IDs as JSON on stdin)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from httpx_sse import aconnect_sse

from bench import machine
from shared import keys
from shared.settings import Settings
from tests.harness import REPO, Stack, free_port
from tests.redis_process import RedisProcess

OUT = REPO / "docs" / "SOAK.md"
DATA_DIR = REPO / ".data" / "soak"
# Greedy SmolLM2 goes on counting for the whole max_tokens after this prompt, so a job is
# still streaming when the outage begins, however idle the machine.
COUNTING = "Count: 1, 2, 3, 4, 5, 6, 7, 8,"
LISTENER_PROCESSES = 2
# uvicorn's access log writes a line per request: the clients' rate, not a flood of errors.
ACCESS_LINE = re.compile(r'"(GET|POST|DELETE) \S+ HTTP/1\.1" \d{3}')

Outcome = dict[str, Any]  # one stream: "last" event, "last_id", "tokens" (indices), "cut"


# -- listeners (run in child processes, so their CPU does not slow the sampling here) --------


async def _listen(client: httpx.AsyncClient, url: str, last_id: str | None) -> Outcome:
    outcome: Outcome = {"last": None, "last_id": last_id, "tokens": [], "cut": None}
    headers = {"Last-Event-ID": last_id} if last_id is not None else {}
    try:
        async with aconnect_sse(client, "GET", url, headers=headers) as source:
            source.response.raise_for_status()
            async for sse in source.aiter_sse():
                if sse.event == "message" and not sse.data:
                    continue  # keep-alive
                outcome["last"] = sse.event
                if sse.event == "token":
                    outcome["tokens"].append(json.loads(sse.data)["index"])
                    outcome["last_id"] = sse.id
                if sse.event in ("done", "error"):
                    break
    except httpx.HTTPError as exc:
        outcome["cut"] = f"{type(exc).__name__}: {exc}"
    return outcome


async def _listen_all(url: str, last_ids: list[str | None]) -> list[Outcome]:
    limits = httpx.Limits(max_connections=len(last_ids) + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(600, connect=120, pool=120)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        return await asyncio.gather(*(_listen(client, url, i) for i in last_ids))


def _listener_main(url: str, n: int) -> None:
    last_ids: list[str | None] = json.loads(sys.stdin.read() or "null") or [None] * n
    print(json.dumps(asyncio.run(_listen_all(url, last_ids))))


class Listeners:
    """`len(last_ids)` streams of one URL, split over child processes."""

    def __init__(self, url: str, last_ids: list[str | None]) -> None:
        self._procs = []
        share = -(-len(last_ids) // LISTENER_PROCESSES)
        for part in range(LISTENER_PROCESSES):
            ids = last_ids[part * share : (part + 1) * share]  # results come back in order
            argv = [sys.executable, "-m", "bench.soak", "listen", url, str(len(ids))]
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(ids))
            proc.stdin.close()
            self._procs.append(proc)

    def results(self, timeout_s: float = 900) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for proc in self._procs:
            assert proc.stdout is not None
            out = proc.stdout.read()
            proc.wait(timeout=timeout_s)
            outcomes += json.loads(out)
        return outcomes


# -- what the soak samples ------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Sampler:
    """`/healthz` latency and the API's RSS every 0.1 s on a thread."""

    url: str
    pid: int
    latencies_ms: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(0.1):
                start = time.perf_counter()
                client.get(f"{self.url}/healthz").raise_for_status()
                self.latencies_ms.append((time.perf_counter() - start) * 1000)
                self.rss_mb.append(_rss_mb(self.pid))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))] if values else float("nan")


def _submit(stack: Stack, max_tokens: int) -> str:
    body = {"prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{stack.url}/v1/jobs", json=body, timeout=30)
    response.raise_for_status()
    return str(response.json()["id"])


def _wait_streaming(stack: Stack, job_id: str, timeout_s: float = 300) -> None:
    client = redis.Redis.from_url(stack.settings.redis_url)
    deadline = time.monotonic() + timeout_s
    while client.xlen(keys.job_events(job_id)) < 5:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} never streamed")
        time.sleep(0.05)
    client.close()


def _wait_ended(stack: Stack, job_ids: list[str], timeout_s: float = 1800) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [httpx.get(f"{stack.url}/v1/jobs/{j}", timeout=30).json() for j in job_ids]
        if all(job["status"] not in ("queued", "started") for job in jobs):
            return jobs
        if time.monotonic() > deadline:
            raise TimeoutError("jobs did not end")
        time.sleep(0.5)


def _log_lines(stack: Stack) -> dict[str, list[str]]:
    return {name: stack.log(name).splitlines() for name in stack.procs}


def _ends(outcomes: list[Outcome]) -> dict[str, int]:
    cut = sum(o["cut"] is not None for o in outcomes)
    ends = {"done": 0, "error": 0, "cut": cut}
    for o in outcomes:
        if o["cut"] is None and o["last"] in ends:
            ends[o["last"]] += 1
    return ends


# -- 1: many listeners ------------------------------------------------------------------------


def streams_section(stack: Stack, n: int) -> str:
    job_id = _submit(stack, max_tokens=400)
    _wait_streaming(stack, job_id)
    api_pid = stack.procs["api"].pid
    rss_before = _rss_mb(api_pid)
    with Sampler(stack.url, api_pid) as idle:  # the same machine, nobody listening
        time.sleep(10)
    start, cpu_before = time.monotonic(), _cpu_s(api_pid)
    with Sampler(stack.url, api_pid) as sampler:
        outcomes = Listeners(f"{stack.url}/v1/jobs/{job_id}/events", [None] * n).results()
    took = time.monotonic() - start
    api_cpu = (_cpu_s(api_pid) - cpu_before) / took
    load = os.getloadavg()[1]
    final = httpx.get(f"{stack.url}/v1/jobs/{job_id}").json()
    every = list(range(final["usage"]["completion_tokens"]))
    whole = sum(o["tokens"] == every for o in outcomes)
    ends = _ends(outcomes)
    p95 = _p95(sampler.latencies_ms)
    peak = max(sampler.rss_mb, default=rss_before)
    return "\n".join(
        [
            f"## {n:,} concurrent SSE listeners on a running job\n",
            f"{n} clients (in {LISTENER_PROCESSES} processes) open `GET /v1/jobs/{{id}}/events` "
            f"at once while a {final['usage']['completion_tokens']}-token job streams; all "
            f"streams over after {took:.1f} s.\n",
            "| measure | target | measured |",
            "|---|---|---|",
            f"| streams ending with `done` | | {ends['done']} |",
            f"| streams ending with `error` | | {ends['error']} |",
            f"| streams cut (no `done`/`error`) | 0 | {_verdict(ends['cut'], ends['cut'] == 0)} |",
            f"| streams with every token, in order | | {whole} |",
            f"| API RSS, peak while listening | ≤ 300 MB | {_verdict(f'{peak:.0f} MB', peak <= 300)}"
            f" (before: {rss_before:.0f} MB) |",
            f"| `/healthz` p95 while listening ({len(sampler.latencies_ms)} samples) | ≤ 100 ms"
            f" | {_verdict(f'{p95:.0f} ms', p95 <= 100)} (median {_median(sampler.latencies_ms):.0f}"
            f" ms, max {max(sampler.latencies_ms):.0f} ms) |",
            f"| `/healthz` p95 before the listeners ({len(idle.latencies_ms)} samples) | | "
            f"{_p95(idle.latencies_ms):.0f} ms |",
            f"| API CPU while listening | | {api_cpu:.0%} of one core |",
            f"| machine load average (5 min, every process on it) | | {load:.1f} on "
            f"{len(os.sched_getaffinity(0))} cores |",
            "",
        ]
    )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


def _verdict(value: object, ok: bool) -> str:
    return f"{value} {'✅' if ok else '❌'}"


# -- 2: Redis down ----------------------------------------------------------------------------


@dataclass
class Outage:
    seconds: float = 0.0
    answers: dict[str, int] = field(default_factory=dict)  # "POST /v1/jobs 503" -> count
    lines: int = 0
    access_lines: int = 0
    recovery_s: float = 0.0


def _ride_out(stack: Stack, server: RedisProcess, outage_s: float) -> Outage:
    before = _log_lines(stack)
    result = Outage()
    server.stop()
    down_at = time.monotonic()
    while time.monotonic() - down_at < outage_s:
        for method, path in (("POST", "/v1/jobs"), ("GET", "/readyz"), ("GET", "/healthz")):
            code = httpx.request(method, f"{stack.url}{path}", json={"prompt": "Hi"}).status_code
            key = f"{method} {path} {code}"
            result.answers[key] = result.answers.get(key, 0) + 1
        time.sleep(1.0)
    after = _log_lines(stack)
    result.seconds = time.monotonic() - down_at
    new = [line for name in after for line in after[name][len(before[name]) :]]
    result.access_lines = sum(bool(ACCESS_LINE.search(line)) for line in new)
    result.lines = len(new) - result.access_lines
    server.start()
    up_at = time.monotonic()
    while (
        httpx.post(f"{stack.url}/v1/jobs", json={"prompt": "Hi", "max_tokens": 1}).status_code
        != 202
    ):
        time.sleep(0.1)
    result.recovery_s = time.monotonic() - up_at
    return result


def outage_section(stack: Stack, server: RedisProcess, outage_s: float, n: int) -> str:
    pids = {name: proc.pid for name, proc in stack.procs.items()}
    jobs = [_submit(stack, max_tokens=900)] + [_submit(stack, max_tokens=40) for _ in range(3)]
    _wait_streaming(stack, jobs[0])
    url = f"{stack.url}/v1/jobs/{jobs[0]}/events"
    open_streams = Listeners(url, [None] * n)
    time.sleep(5)  # connected, and streaming
    running = httpx.get(f"{stack.url}/v1/jobs/{jobs[0]}").json()["status"] == "started"
    outage = _ride_out(stack, server, outage_s)
    interrupted = open_streams.results()
    resumed = Listeners(url, [o["last_id"] for o in interrupted]).results()
    ended = _wait_ended(stack, jobs)
    finished = sum(job["status"] == "finished" for job in ended)
    every = list(range(ended[0]["usage"]["completion_tokens"]))
    whole = sum(
        a["tokens"] + b["tokens"] == every for a, b in zip(interrupted, resumed, strict=True)
    )
    warm_after = _warm_run_since(stack, time.time() - outage.recovery_s - 5, timeout_s=60)
    alive = {name: proc.pid for name, proc in stack.procs.items() if proc.poll() is None}
    restarts = {name: int(alive.get(name) != pid) for name, pid in pids.items()}
    loads = stack.log("worker").count("model smollm2-135m loaded")
    per_s = outage.lines / outage.seconds
    answers = ", ".join(f"`{k}` ×{v}" for k, v in sorted(outage.answers.items()))
    before, after = _ends(interrupted), _ends(resumed)
    cut = _verdict(f"{before['cut']} cut", before["cut"] == 0)
    return "\n".join(
        [
            f"## Redis down {outage.seconds:.0f} s\n",
            f"Redis is stopped (SIGTERM) while a job ({len(every)} tokens in the end) streams to "
            f"{n} listeners and three more jobs wait in the queue, then started again on the "
            "same port. The stack keeps running throughout.\n",
            "| measure | target | measured |",
            "|---|---|---|",
            f"| worker restarts | 0 | {_verdict(restarts['worker'], restarts['worker'] == 0)}"
            f" (same PID; model loaded {loads}×) |",
            f"| warmer restarts | 0 | {_verdict(restarts['warmer'], restarts['warmer'] == 0)}"
            f" (a scheduled run after the outage: {'yes' if warm_after else 'no'}) |",
            f"| log lines per second during the outage, all processes | ≤ 5 | "
            f"{_verdict(f'{per_s:.2f}', per_s <= 5)} ({outage.lines} lines; plus "
            f"{outage.access_lines} access-log lines, one per request the soak sent) |",
            f"| jobs queued before the outage that finished after it | all (4) | "
            f"{_verdict(finished, finished == len(jobs))} |",
            f"| API answers during the outage | 503 | {answers} |",
            f"| API serving again after Redis answers | | {outage.recovery_s:.1f} s |",
            f"| the streamed job still running when Redis stopped | yes | "
            f"{_verdict('yes' if running else 'no', running)} |",
            f"| open streams at the outage: ended with | `error`, 0 cut | {before['error']} "
            f"`error`, {before['done']} `done`, {cut} |",
            f"| the same streams resumed with `Last-Event-ID` | `done` | {after['done']} `done`, "
            f"{after['cut']} cut; {whole} of {n} with every token exactly once |",
            "",
        ]
    )


def _warm_run_since(stack: Stack, since: float, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = httpx.get(f"{stack.url}/v1/warm/runs", timeout=30).json()
        if any(run["started_at"] > since for run in runs):
            return True
        time.sleep(1)
    return False


# -- 3: a huge body ---------------------------------------------------------------------------


def _post_timed(url: str, content: bytes | Any) -> tuple[int, float]:
    headers = {"Content-Type": "application/json"}
    start = time.perf_counter()
    try:
        status = httpx.post(url, content=content, headers=headers, timeout=120).status_code
    except httpx.HTTPError:  # the API may close the connection while a body is still coming
        status = 0
    return status, time.perf_counter() - start


def _streamed(total: int, chunk: int = 1 << 20) -> Any:
    yield b'{"prompt": "'
    for _ in range(total // chunk):
        yield b"a" * chunk
    yield b'"}'


def body_section(stack: Stack, megabytes: int) -> str:
    """A body of `megabytes` MB, with its length declared and streamed without one."""
    url = f"{stack.url}/v1/jobs"
    api_pid = stack.procs["api"].pid
    size = megabytes * 1_000_000
    rows = []
    for how, content in (
        ("Content-Length declared", b'{"prompt": "' + b"a" * size + b'"}'),
        ("chunked, no length", _streamed(size)),
    ):
        before = _rss_mb(api_pid)
        with Sampler(stack.url, api_pid) as sampler:
            status, took = _post_timed(url, content)
        grew = max(sampler.rss_mb, default=before) - before
        rows.append(
            f"| {how} | {status} | {_verdict(f'{took:.2f} s', took <= 1)} | "
            f"{_verdict(f'{grew:.0f} MB', grew < 50)} |"
        )
    limit = stack.settings.api.max_body_bytes
    return "\n".join(
        [
            f"## A {megabytes} MB request body\n",
            f"`POST /v1/jobs` with a {megabytes} MB prompt; `api.max_body_bytes` is {limit:,}. "
            "Time is from the first byte sent to the answer (it includes sending what the API "
            "read before refusing); memory is the API's peak resident growth meanwhile.\n",
            "| how it is sent | status | answered within (target ≤ 1 s) "
            "| API memory growth (target < 50 MB) |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )


# -- the whole soak ---------------------------------------------------------------------------


def _ports(base: int) -> tuple[int, int]:
    return (base, base + 1) if base else (free_port(), free_port())


def run(listeners: int, outage_s: float, port_base: int, outage_listeners: int) -> str:
    api_port, redis_port = _ports(port_base)
    with (
        tempfile.TemporaryDirectory(prefix="granary-soak-") as tmp,
        RedisProcess(Path(tmp) / "redis", redis_port) as server,
    ):
        settings = Settings(
            redis_url=server.url,
            data_dir=DATA_DIR,
            n_ctx=1024,
            api={"port": api_port},
            warmer={"schedule": "*/10 * * * * *"},
            # Its jobs must run (listeners watch them stream): none comes from the store.
            result_cache={"enabled": False},
        )
        stack = Stack(settings, Path(tmp))
        try:
            stack.start_api()
            stack.start_worker("worker")
            stack.start_warmer()
            streams = streams_section(stack, listeners)
            outage = outage_section(stack, server, outage_s, outage_listeners)
            body = body_section(stack, megabytes=50)
        finally:
            stack.stop()
    return "\n".join(
        [
            "# Soak: streams under load, and a Redis outage\n",
            "Generated by `make soak` (`bench/soak.py`); not part of `make test`. Issue 15's "
            "targets for held streams and ridden-out Redis outages, measured on real processes "
            "over loopback: an API, one worker (SmolLM2-135M) and the warmer, and a private "
            "redis-server with `appendonly yes`, `appendfsync everysec`. The listening clients "
            "run on the same machine, in their own processes, and take CPU from the stack; "
            "latencies also depend on whatever else the machine runs, so the first table gives "
            "the API's own CPU use and the machine's load average beside them.\n",
            machine.describe(),
            streams,
            outage,
            body,
        ]
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "listen":
        _listener_main(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listeners", type=int, default=1000)
    parser.add_argument("--outage-s", type=float, default=30.0)
    parser.add_argument("--outage-listeners", type=int, default=200)
    parser.add_argument("--port-base", type=int, default=0, help="API here, Redis at +1")
    args = parser.parse_args()
    text = run(args.listeners, args.outage_s, args.port_base, args.outage_listeners)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
