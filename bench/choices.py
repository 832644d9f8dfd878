"""`n` choices against one: what four sampled continuations of one prompt cost over one.

Qwen2.5-Coder-0.5B, one API and one worker (2 threads, the defaults), through
`POST /v1/completions` (the full job path, not streamed): a ~1,000-token inventory (new numbers
for every request, so no prefix is cached) that every choice writes on for all of its 64
tokens, temperature 0.8 and a seed. Each round sends one request with `n = 1` and one with
`n = 4` (each on a prompt of its own, of the same length), alternating which goes first; the
ratio per round is n = 4's wall time over n = 1's. Target (issue 38): at most 1.5 times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.completions import served
from bench.conclave import document
from bench.paired import per_round, ratio_summary
from shared.models import resolve_model
from shared.settings import Settings

MODEL = "qwen2.5-coder-0.5b"
CHOICES = 4
MAX_TOKENS = 64
TARGET = 1.5


@dataclass(frozen=True, slots=True)
class Answer:
    seconds: float
    prompt_tokens: int
    completion_tokens: int


def ask(url: str, seed: int, n: int) -> Answer:
    body = {
        "model": MODEL,
        "prompt": document(seed, lines=30) + "\n",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": 7,
        "n": n,
    }
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    seconds = time.perf_counter() - started
    usage = reply.json()["usage"]
    assert len(reply.json()["choices"]) == n
    return Answer(seconds, usage["prompt_tokens"], usage["completion_tokens"])


def measure(settings: Settings, log_dir: Path, rounds: int) -> list[tuple[Answer, Answer]]:
    """Per round: (n = 1, n = CHOICES)."""
    pairs = []
    with served(settings, resolve_model(MODEL, settings.data_dir), log_dir, db=3) as stack:
        ask(stack.url, 1, 1)  # first-request costs, on a document of its own
        for r in range(rounds):
            order = (1, CHOICES) if r % 2 == 0 else (CHOICES, 1)
            got = {n: ask(stack.url, 10_000 * (2 * r + k + 2), n) for k, n in enumerate(order)}
            pairs.append((got[1], got[CHOICES]))
    return pairs


def section(settings: Settings, log_dir: Path, rounds: int) -> str:
    pairs = measure(settings, log_dir, rounds)
    ratios = per_round([many.seconds for _, many in pairs], [one.seconds for one, _ in pairs])
    rows = [
        f"| {r + 1} | {one.prompt_tokens:,} | {one.seconds:.2f} ({one.completion_tokens}) "
        f"| {many.seconds:.2f} ({many.completion_tokens}) | {ratio:.2f}× |"
        for r, ((one, many), ratio) in enumerate(zip(pairs, ratios, strict=True))
    ]
    verdict = "met" if sorted(ratios)[len(ratios) // 2] <= TARGET else "MISSED"
    return "\n".join(
        [
            "## n choices of one request",
            "",
            __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            f"| round | prompt tokens | n = 1: s (tokens decoded) | n = {CHOICES}: s (tokens "
            f"decoded) | n = {CHOICES} / n = 1 |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"n = {CHOICES} over n = 1: {ratio_summary(ratios)} (target ≤ {TARGET}×: {verdict}).",
            "",
        ]
    )
