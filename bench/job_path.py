"""Decode speed and time to first token: the full job path versus raw llama-cpp-python.

Both run the same model, thread count, context size, prompt and greedy decoding, alternately
(raw, job, raw, job, ...) in one run, so machine drift hits both alike; ratios are per pair.
The raw side is `Llama.generate` in this process while the stack's worker sits idle.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import httpx
import orjson
from httpx_sse import connect_sse

from shared.llm import load_llama
from shared.settings import Settings
from tests.harness import Stack

PROMPT = (
    "Below is a list of the numbers from one to five hundred, written in digits and separated "
    "by commas.\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
)


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    decode_tps: float
    tokens: int


def _rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def raw_run(settings: Settings, prompt: str, max_tokens: int) -> Sample:
    llama = load_llama(settings)
    try:
        tokens = llama.tokenize(prompt.encode(), add_bos=True, special=True)
        started = time.perf_counter()
        stamps: list[float] = []
        for _ in llama.generate(tokens, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) >= max_tokens:
                break
        return Sample(stamps[0] - started, _rate(stamps), len(stamps))
    finally:
        llama.close()


def job_run(stack: Stack, prompt: str, max_tokens: int) -> Sample:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with httpx.Client(base_url=stack.url, timeout=600) as client:
        started = time.perf_counter()
        job = client.post("/v1/jobs", json=body).json()
        stamps: list[float] = []
        with connect_sse(client, "GET", f"/v1/jobs/{job['id']}/events") as source:
            for sse in source.iter_sse():
                if sse.event != "token":
                    final = orjson.loads(sse.data)
                    break
                stamps.append(time.perf_counter())
    assert final["status"] == "finished", final
    return Sample(stamps[0] - started, _rate(stamps), final["usage"]["completion_tokens"])


def compare(stack: Stack, settings: Settings, rounds: int, max_tokens: int) -> str:
    # One unrecorded pair first: page-cache, allocator and first-request costs land there.
    raw_run(settings, f"Warm-up. {PROMPT}", 8)
    job_run(stack, f"Warm-up. {PROMPT}", 8)
    pairs: list[tuple[Sample, Sample]] = []
    for i in range(rounds):
        # A different first line each round: neither side may re-use the previous prompt.
        prompt = f"Round {i}. {PROMPT}"
        pairs.append((raw_run(settings, prompt, max_tokens), job_run(stack, prompt, max_tokens)))
    raw_tps = statistics.median(r.decode_tps for r, _ in pairs)
    job_tps = statistics.median(j.decode_tps for _, j in pairs)
    ratio = statistics.median(j.decode_tps / r.decode_tps for r, j in pairs)
    raw_ttft = statistics.median(r.ttft_s for r, _ in pairs) * 1000
    job_ttft = statistics.median(j.ttft_s for _, j in pairs) * 1000
    tokens = {r.tokens for r, _ in pairs} | {j.tokens for _, j in pairs}
    verdict = "meets" if ratio >= 0.95 else "MISSES"
    return (
        f"| {settings.model} | {settings.threads} | {rounds} | {sorted(tokens)} | "
        f"{raw_tps:.1f} | {job_tps:.1f} | **{ratio:.3f}** ({verdict} ≥ 0.95) | "
        f"{raw_ttft:.0f} | {job_ttft:.0f} |"
    )


HEADER = """## Job path versus raw llama-cpp-python

Decode tokens/s and time to first token (TTFT) for the same greedy generation: raw
`Llama.generate` in one process, versus the full job path (HTTP POST → Redis/rq → resident
worker → Redis stream + pub/sub → SSE to the client, timed at the client). Runs alternate raw/job;
the ratio is the median of per-pair ratios. Target: the job path keeps ≥ 95% of raw decode speed.
The job path's TTFT includes the HTTP round trip, queueing and the worker picking the job up;
the raw TTFT is tokenize + prefill + first sample only. The disk prefix cache is off here (raw
llama-cpp-python has none); the API, Redis and the SSE client share the same 2 cores. Expect a
few percent of spread between runs of this table on a shared machine.

| model | threads | pairs | tokens | raw decode tok/s | job decode tok/s | job/raw | raw TTFT ms | job TTFT ms |
|---|---|---|---|---|---|---|---|---|
"""
