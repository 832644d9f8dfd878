"""`n` choices against one, and against as many separate requests: what four sampled
continuations of one prompt cost.

Qwen2.5-Coder-0.5B, one API and one worker (2 threads, the defaults), through
`POST /v1/completions` (the full job path, not streamed): a ~1,000-token inventory (new numbers
for every request, so no prefix is cached) that every choice writes on for all of its 64
tokens, temperature 0.8 and a seed. Each round sends one request with `n = 1`, one with
`n = 4`, and four requests with `n = 1` at once (seeds 7-10, what `n = 4` draws), each kind on a
prompt of its own of the same length, in an order that rotates; the ratio per round is over
`n = 1`'s wall time. Prompt tokens computed: what the worker's `/metrics` counted as prompt
tokens not cached, over the request. Target (issue 38): `n = 4` at most 1.5 times `n = 1`.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.completions import served
from bench.conclave import document
from bench.paired import in_turn, per_round, ratio_summary
from shared.models import resolve_model
from shared.settings import Settings

MODEL = "qwen2.5-coder-0.5b"
CHOICES = 4
MAX_TOKENS = 64
TARGET = 1.5


KINDS = ("n = 1", f"n = {CHOICES}", f"{CHOICES} requests")


@dataclass(frozen=True, slots=True)
class Answer:
    seconds: float
    computed: int  # prompt tokens the worker computed (not cached)
    completion_tokens: int


def ask(url: str, prompt_seed: int, n: int, seed: int = 7) -> int:
    body = {
        "model": MODEL,
        "prompt": document(prompt_seed, lines=30) + "\n",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": seed,
        "n": n,
    }
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    assert len(reply.json()["choices"]) == n
    completion: int = reply.json()["usage"]["completion_tokens"]
    return completion


def uncached_prompt_tokens(url: str) -> int:
    """Prompt tokens every finished job counted, less those it found cached (`/metrics`)."""
    counters = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        counters[name] = value
    return int(
        float(counters["granary_prompt_tokens_total"])
        - float(counters["granary_cached_tokens_total"])
    )


def measured(url: str, kind: str, prompt_seed: int) -> Answer:
    before = uncached_prompt_tokens(url)
    started = time.perf_counter()
    if kind == KINDS[0]:
        decoded = ask(url, prompt_seed, 1)
    elif kind == KINDS[1]:
        decoded = ask(url, prompt_seed, CHOICES)
    else:
        with ThreadPoolExecutor(CHOICES) as pool:
            seeds = [7 + i for i in range(CHOICES)]
            decoded = sum(pool.map(lambda seed: ask(url, prompt_seed, 1, seed), seeds))
    seconds = time.perf_counter() - started
    return Answer(seconds, uncached_prompt_tokens(url) - before, decoded)


def measure(settings: Settings, log_dir: Path, rounds: int) -> list[dict[str, Answer]]:
    """Per round, each kind's answer."""
    got = []
    with served(settings, resolve_model(MODEL, settings.data_dir), log_dir, db=3) as stack:
        ask(stack.url, 1, 1)  # first-request costs, on a document of its own
        for r in range(rounds):
            order = in_turn(KINDS, r)
            got.append(
                {k: measured(stack.url, k, 10_000 * (3 * r + i + 2)) for i, k in enumerate(order)}
            )
    return got


def section(settings: Settings, log_dir: Path, rounds: int) -> str:
    got = measure(settings, log_dir, rounds)
    ratios = {
        k: per_round([g[k].seconds for g in got], [g[KINDS[0]].seconds for g in got])
        for k in KINDS[1:]
    }
    rows = [
        f"| {r + 1} | "
        + " | ".join(
            f"{g[k].seconds:.2f} s, {g[k].computed:,} ({g[k].completion_tokens})" for k in KINDS
        )
        + " | "
        + " | ".join(f"{ratios[k][r]:.2f}×" for k in KINDS[1:])
        + " |"
        for r, g in enumerate(got)
    ]
    many = ratios[KINDS[1]]
    verdict = "met" if sorted(many)[len(many) // 2] <= TARGET else "MISSED"
    return "\n".join(
        [
            "## n choices of one request",
            "",
            __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            "| round | "
            + " | ".join(f"{k}: time, prompt tokens computed (tokens decoded)" for k in KINDS)
            + " | "
            + " | ".join(f"{k} / n = 1" for k in KINDS[1:])
            + " |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"{KINDS[1]} over n = 1: {ratio_summary(many)} (target ≤ {TARGET}×: {verdict}); "
            f"{KINDS[2]} over n = 1: {ratio_summary(ratios[KINDS[2]])}.",
            "",
        ]
    )
