"""Speculative decoding off, on and auto: decode speed on copy-heavy answers and on free text.

One worker serves every job, greedy, the three modes interleaved question by question (off,
on, auto, off, ...), so machine drift hits all three alike; the worker's controller carries
what it learned from job to job, as in production. Workloads:
- copy-heavy document jobs: each answer quotes a line of a ledger document;
- the same questions as one extraction job (drafting inside the multi-question decode);
- free-form generation: short essays, nothing to copy.
Decode speed of a document or free-form job is the worker's own figure (answer tokens from the
first to the last); of an extraction job, answer tokens over the job's time after the document
prefill (the questions' own prefill included).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prefix_cache import document
from shared.settings import Settings
from tests.harness import Stack

MODES = ("off", "on", "auto")
LINES = (4, 11, 19, 27)
TOPICS = ("the bicycle", "paper money", "the printing press", "lighthouses")
COPY_TOKENS = 96
FREE_TOKENS = 96


@dataclass
class Tally:
    """Answer tokens and decode seconds of one mode on one workload, and what it drafted."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def add(self, tokens: int, seconds: float, view: dict[str, Any], text: str) -> None:
        self.tokens += tokens
        self.seconds += seconds
        report = view.get("speculation") or {}
        self.drafted += report.get("drafted", 0)
        self.accepted += report.get("accepted", 0)
        self.texts.append(text)


Measure = Callable[[httpx.Client, str], tuple[int, float, dict[str, Any], str]]


def _finished(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    job_id = client.post(path, json=body).json()["id"]
    while (view := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "started"):
        time.sleep(0.05)
    assert view["status"] == "finished", view
    result: dict[str, Any] = view
    return result


def _generation(path_body: dict[str, Any]) -> Measure:
    def measure(client: httpx.Client, mode: str) -> tuple[int, float, dict[str, Any], str]:
        view = _finished(client, "/v1/jobs", path_body | {"speculation": mode})
        tokens, rate = view["usage"]["completion_tokens"], view["timings"]["decode_tokens_per_s"]
        if not rate:  # a one-token answer has no decode rate
            return 0, 0.0, view, view["result"]["text"]
        # The worker's rate runs from the first token to the last: tokens - 1 intervals.
        return tokens - 1, (tokens - 1) / rate, view, view["result"]["text"]

    return measure


def _extraction(body: dict[str, Any]) -> Measure:
    def measure(client: httpx.Client, mode: str) -> tuple[int, float, dict[str, Any], str]:
        view = _finished(client, "/v1/extractions", body | {"speculation": mode})
        seconds = view["finished_at"] - view["started_at"] - view["timings"]["prefill_ms"] / 1000
        answers = view["extraction"]["answers"]
        text = "\n".join(answers[k]["text"] for k in sorted(answers))
        return view["usage"]["completion_tokens"], seconds, view, text

    return measure


def _workloads(doc: str) -> dict[str, list[Measure]]:
    copy = [f"Quote lines {n} to {n + 2} of the ledger exactly as written." for n in LINES]
    base = {"document": doc, "temperature": 0, "max_tokens": COPY_TOKENS}
    return {
        "copy-heavy document jobs (answers quote the document)": [
            _generation(base | {"prompt": q}) for q in copy
        ],
        "copy-heavy extraction job (4 questions decoded together)": [
            _extraction(
                base | {"questions": [{"id": str(i), "question": q} for i, q in enumerate(copy)]}
            )
        ],
        "free-form generation": [
            _generation(
                {
                    "messages": [
                        {"role": "user", "content": f"Write a paragraph on the history of {t}."}
                    ],
                    "temperature": 0,
                    "max_tokens": FREE_TOKENS,
                }
            )
            for t in TOPICS
        ],
    }


def measure(stack: Stack, rounds: int) -> dict[str, dict[str, Tally]]:
    workloads = _workloads(document(40, seed=77).rsplit("\n", 1)[0])
    tallies = {name: {mode: Tally() for mode in MODES} for name in workloads}
    with httpx.Client(base_url=stack.url, timeout=900) as client:
        for name, jobs in workloads.items():
            jobs[0](client, "off")  # the document's prefill, cached for everyone after
            for _ in range(rounds):
                for job in jobs:
                    for mode in MODES:
                        tallies[name][mode].add(*job(client, mode))
    return tallies


def section(settings: Settings, stack: Stack, rounds: int) -> str:
    tallies = measure(stack, rounds)
    rows = [_row(name, modes) for name, modes in tallies.items()]
    copy = tallies["copy-heavy document jobs (answers quote the document)"]
    free = tallies["free-form generation"]
    copy_x = copy["auto"].rate / copy["off"].rate
    free_x = free["auto"].rate / free["off"].rate
    verdict = (
        f"auto is **{copy_x:.2f}×** off on copy-heavy answers (target ≥ 1.5×: "
        f"{'met' if copy_x >= 1.5 else 'MISSED'}) and **{free_x:.2f}×** off on free text "
        f"(target ≥ 0.97×: {'met' if free_x >= 0.97 else 'MISSED'})"
    )
    differences = "\n".join(_differences(tallies)) or "none"
    return f"""## Speculative decoding: off, on, auto

{settings.model}, {settings.threads} threads, greedy, one worker; the three modes interleaved
job by job, {rounds} round(s) of every question. Drafts come from n-grams of the prompt (the
document), of the job's own output and of the worker's archive of past outputs; `auto` is the
controller deciding by measured speed. Answer tokens per second of decoding (see
`bench/speculation.py` for how each is timed); "same text" compares with `off` (greedy output
must not change). Result: {verdict}.

| workload | off tok/s | on tok/s | auto tok/s | acceptance (on) | same text as off (on / auto) |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Texts that differ from `off` (where they part): {differences}
"""


def _differences(tallies: dict[str, dict[str, Tally]]) -> list[str]:
    found = []
    for name, modes in tallies.items():
        for mode in ("on", "auto"):
            for i, (a, b) in enumerate(zip(modes["off"].texts, modes[mode].texts, strict=True)):
                if a != b:
                    at = _common_prefix(a, b)
                    found.append(
                        f"\n- {name}, {mode}, job {i}: off {a[at - 20 : at + 30]!r}, "
                        f"{mode} {b[at - 20 : at + 30]!r}"
                    )
    return found


def _common_prefix(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _row(name: str, modes: dict[str, Tally]) -> str:
    off, on, auto = (modes[m] for m in MODES)
    acceptance = f"{on.accepted / on.drafted:.0%}" if on.drafted else "—"

    def same(tally: Tally) -> str:
        equal = sum(a == b for a, b in zip(tally.texts, off.texts, strict=True))
        return f"{equal}/{len(off.texts)}"

    return (
        f"| {name} | {off.rate:.1f} | {on.rate:.1f} ({on.rate / off.rate:.2f}×) | "
        f"{auto.rate:.1f} ({auto.rate / off.rate:.2f}×) | {acceptance} | "
        f"{same(on)} / {same(auto)} |"
    )
