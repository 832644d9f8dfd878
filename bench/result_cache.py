"""A repeated identical greedy request: time to first token through the full job path.

Each round sends a greedy request no earlier round sent (it runs on the worker), then the same
request again (answered from the result store). Both are timed at the client as the job path
bench times them: POST /v1/jobs, then the job's SSE stream until its first token.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import redis

from bench.job_path import PROMPT
from bench.prefix_cache import timed_job
from shared import keys
from shared.settings import Settings
from tests.harness import Stack

TARGET_MS = 20.0


def _wait_stored(settings: Settings, count: int) -> None:
    """The worker stores a result just after the job's `done`: the repeat must find it."""
    client = redis.Redis.from_url(settings.redis_url)
    deadline = time.monotonic() + 10
    while client.zcard(keys.result_index()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError("the worker stored no result")
        time.sleep(0.01)


def _ttft_ms(stack: Stack, prompt: str, max_tokens: int, cached: bool) -> float:
    """POST, then the SSE stream until the first token; checks where the answer came from."""
    run = timed_job(stack, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert run.job["usage"]["cached_result"] is cached, run.job["usage"]
    return run.client_ttft_s * 1000


def measure(stack: Stack, settings: Settings, rounds: int, repeats: int, max_tokens: int) -> str:
    _ttft_ms(stack, f"Warm-up. {PROMPT}", 8, cached=False)  # first-request costs land here
    first: list[float] = []
    again: list[float] = []
    for i in range(rounds):
        prompt = f"Round {i}. {PROMPT}"
        first.append(_ttft_ms(stack, prompt, max_tokens, cached=False))
        _wait_stored(settings, i + 2)
        again += [_ttft_ms(stack, prompt, max_tokens, cached=True) for _ in range(repeats)]
    first_ms, again_ms = statistics.median(first), statistics.median(again)
    verdict = "meets" if again_ms <= TARGET_MS else "MISSES"
    return (
        f"| {settings.model} | {settings.threads} | {rounds} × {repeats} | {max_tokens} | "
        f"{first_ms:.0f} | **{again_ms:.1f}** ({verdict} ≤ {TARGET_MS:.0f}) | "
        f"{max(again):.1f} | {first_ms / again_ms:.0f}× |"
    )


def section(settings: Settings, log_dir: Path, rounds: int, repeats: int) -> str:
    stack = Stack(settings, log_dir)
    try:
        stack.start_api()
        stack.start_worker()
        row = measure(stack, settings, rounds, repeats, max_tokens=64)
    finally:
        stack.stop()
    return HEADER + row + "\n"


HEADER = """## A repeated identical greedy request

Time to first token at the client through the full job path (HTTP POST → API → SSE), for a
greedy request no earlier one sent (it runs on the worker, prefix cache off: a cold prefill of
~65 tokens, then the first token), then the
same request again, answered from the result store (`usage.cached_result`: the API finishes
the job with the stored run's events before the POST returns). Medians; the repeat's maximum
too. Target: a repeat's TTFT ≤ 20 ms.

| model | threads | rounds × repeats | max tokens | first TTFT ms | repeat TTFT ms | repeat max ms | first/repeat |
|---|---|---|---|---|---|---|---|
"""
