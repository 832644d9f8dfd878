"""Scheduled warming through the full job path: time to first token after a nightly-style warm
run versus cold, and how long an interactive job waits behind warm prefill.

Each round uses two fresh documents: one the warmer warmed (a spec file, a cron schedule in
seconds), one nobody did. Both are asked on a freshly started worker process, so nothing is in
the model's memory: a warm start can only come from what the warm run left in the cache.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.prefix_cache import Run, document, fresh_worker, timed_job
from shared.settings import Settings
from tests.harness import Stack

INSTRUCTIONS = "Answer questions about this purchase order ledger."
QUESTION = "How many lines are pending? Answer:"


# The ledger as sent: these figures measure restores, not normalisation (bench/exam.py does).
DOC_FIELDS = {"instructions": INSTRUCTIONS, "document_format": "raw"}


def ask(stack: Stack, doc: str) -> Run:
    return timed_job(stack, {"document": doc, **DOC_FIELDS, "prompt": QUESTION})


def _runs(stack: Stack) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = httpx.get(f"{stack.url}/v1/warm/runs").json()
    return runs


def _wait_for_run(stack: Stack, timeout_s: float = 1800) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [r for r in _runs(stack) if r["finished_at"] is not None]
        if done:
            detail: dict[str, Any] = httpx.get(f"{stack.url}/v1/warm/runs/{done[-1]['id']}").json()
            return detail
        time.sleep(1)
    raise TimeoutError("the scheduled warm run did not finish")


def _spec_dir(root: Path, docs: list[str]) -> Path:
    (root / "docs").mkdir(parents=True)
    for i, doc in enumerate(docs):
        (root / "docs" / f"ledger-{i}.txt").write_text(doc, encoding="utf-8")
    (root / "specs").mkdir()
    # As the requests send them (DOC_FIELDS): a spec warms exactly what its requests read.
    (root / "specs" / "ledgers.toml").write_text(
        f'instructions = "{INSTRUCTIONS}"\ndocuments = ["../docs/*.txt"]\n'
        f'document_format = "{DOC_FIELDS["document_format"]}"\n',
        encoding="utf-8",
    )
    return root / "specs"


def section(settings: Settings, log_dir: Path, n_items: int, rounds: int) -> str:
    warmed = [document(n_items, seed=500 + r).rsplit("\n", 1)[0] for r in range(rounds)]
    cold = [document(n_items, seed=900 + r).rsplit("\n", 1)[0] for r in range(rounds)]
    warmer = settings.warmer.model_copy(
        update={"schedule": "*/5 * * * * *", "spec_dir": _spec_dir(log_dir / "warm", warmed)}
    )
    stack = Stack(settings.model_copy(update={"warmer": warmer}), log_dir)
    try:
        stack.start_api()
        stack.start_worker("worker-1")
        stack.start_warmer()
        run = _wait_for_run(stack)
        stack.stop_process("warmer")  # one scheduled run is what is measured
        worker, pairs = 1, []
        for r in range(rounds):
            worker = fresh_worker(stack, worker)
            c = ask(stack, cold[r])
            worker = fresh_worker(stack, worker)
            w = ask(stack, warmed[r])
            pairs.append((c, w))
        wait_ms, chunk_ms = _interactive_wait(stack, document(n_items, seed=77))
    finally:
        stack.stop()
    return _render(settings, run, pairs, wait_ms, chunk_ms)


def _interactive_wait(stack: Stack, doc: str) -> tuple[float, float]:
    """Queue wait of a short interactive job submitted while a warm job is prefilling."""
    with httpx.Client(base_url=stack.url, timeout=600) as client:
        run = client.post("/v1/warm", json={"document": doc, **DOC_FIELDS}).json()
        warm_id = run["jobs"][0]["id"]
        while client.get(f"/v1/jobs/{warm_id}").json()["status"] != "started":
            time.sleep(0.05)
        time.sleep(1.0)
        job = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 2}).json()
        while (view := client.get(f"/v1/jobs/{job['id']}").json())["status"] != "finished":
            time.sleep(0.05)
        while (warm := client.get(f"/v1/jobs/{warm_id}").json())["status"] != "finished":
            time.sleep(0.2)
    # One chunk of warm prefill: its whole prefill time over its chunks.
    prefill_s = warm["finished_at"] - warm["started_at"]
    chunks = max(warm["warm"]["warmed_tokens"] / 256, 1)
    return float(view["timings"]["queued_ms"]), prefill_s * 1000 / chunks


def _render(
    settings: Settings,
    run: dict[str, Any],
    pairs: list[tuple[Run, Run]],
    wait_ms: float,
    chunk_ms: float,
) -> str:
    ratios = [c.client_ttft_s / w.client_ttft_s for c, w in pairs]
    rows = "\n".join(
        f"| {i + 1} | {c.job['usage']['prompt_tokens']} | {w.job['usage']['cached_tokens']} | "
        f"{c.client_ttft_s * 1000:.0f} | {w.client_ttft_s * 1000:.0f} | {ratio:.0f}× |"
        for i, ((c, w), ratio) in enumerate(zip(pairs, ratios, strict=True))
    )
    prefix = {job["warm"]["prefix_tokens"] for job in run["jobs"]}
    whole = all(w.job["usage"]["cached_tokens"] in prefix for _, w in pairs)
    return f"""## Warmer: time to first token after a scheduled warm run

{settings.model}, {settings.threads} threads, full job path (HTTP → Redis/rq → worker → SSE),
time to first token at the client. The warmer process ran one scheduled run (cron in seconds)
over a spec directory of {len(pairs)} ledger documents; its run computed
{run["warmed_tokens"]} prefix tokens in {run["finished_at"] - run["started_at"]:.0f} s. Then each
round asks one question about a document nobody warmed (cold) and one about a warmed document
(warm), each on a freshly started worker process. Per-round ratio; median
**{statistics.median(ratios):.0f}×**. Warm requests restored the whole document (not only its
whole blocks): **{"yes" if whole else "NO"}**.

| round | prompt tokens | restored tokens (warm) | cold TTFT ms | warm TTFT ms | cold/warm |
|---|---|---|---|---|---|
{rows}

Priority: a short interactive job submitted while a warm job was prefilling a document waited
**{wait_ms:.0f} ms** in the queue; one chunk (256 tokens) of that warm prefill took
{chunk_ms:.0f} ms on average. The warm job reads at the lowest priority, a chunk at a time
between the other jobs' steps.
"""
