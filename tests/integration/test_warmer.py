"""The warmer and warm jobs through the whole stack: real processes, Redis and SmolLM2."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import redis

from shared import keys
from shared.job_store import JobStore
from shared.settings import Settings
from shared.warm_runs import WarmRuns, WarmRunView
from tests.harness import HTTP, Stack, settings_env
from tests.integration.test_job_path import events, submit, wait_status

CACHE = {"block_tokens": 64, "min_tokens": 16}
INSTRUCTIONS = "Answer from the invoice only."
INVOICE = " ".join(
    f"Line {i}: {i * 3 % 17} boxes of tea, {i * 7 % 11} EUR each." for i in range(14)
)
QUESTION = {"instructions": INSTRUCTIONS, "prompt": "What is the total?", "max_tokens": 8}


def ask(stack: Stack, document: str, **extra: Any) -> dict[str, Any]:
    body = {**QUESTION, "document": document, "temperature": 0, **extra}
    final = events(stack, submit(stack, body)["id"])[-1][2]
    assert final["status"] == "finished", final
    return final


def warm_runs(stack: Stack) -> list[dict[str, Any]]:
    response = HTTP.get(f"{stack.url}/v1/warm/runs")
    assert response.status_code == 200, response.text
    runs: list[dict[str, Any]] = response.json()
    return runs


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def finished_runs(stack: Stack) -> list[dict[str, Any]]:
    return [r for r in warm_runs(stack) if r["finished_at"] is not None]


def spec_dir(tmp_path: Path, *documents: str) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(documents):
        (docs / f"invoice-{i}.txt").write_text(text, encoding="utf-8")
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "invoices.toml").write_text(
        f'instructions = "{INSTRUCTIONS}"\ndocuments = ["../docs/*.txt"]\n', encoding="utf-8"
    )
    return specs


def test_a_scheduled_run_warms_the_whole_document(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    warmer = {"schedule": "*/3 * * * * *", "spec_dir": spec_dir(tmp_path, INVOICE)}
    stack = stack_factory(cache=CACHE, warmer=warmer)
    stack.start_warmer()
    first = wait_for(lambda: finished_runs(stack), "a scheduled run to finish")[-1]
    assert first["trigger"] == "schedule" and first["counts"]["finished"] == 1, first
    prefix = first["prefix_tokens"]
    assert first["warmed_tokens"] == prefix > 0 and prefix % CACHE["block_tokens"] != 0
    # A request for that document restores all of it, not just whole blocks.
    answer = ask(stack, INVOICE)
    assert answer["usage"]["cached_tokens"] == prefix
    # Runs keep firing; none computes the document again.
    later = wait_for(
        lambda: [r for r in finished_runs(stack) if r["started_at"] > first["finished_at"]],
        "a run after the first",
    )[-1]
    assert later["warmed_tokens"] == 0 and later["already_cached"] == 1, later
    metrics = HTTP.get(f"{stack.url}/metrics").text
    assert 'granary_warm_runs_total{trigger="schedule"}' in metrics
    assert f"granary_warm_tokens_total {float(prefix)}" in metrics


def test_warm_jobs_step_aside_for_interactive_ones(stack_factory: Callable[..., Stack]) -> None:
    # One job at a time: the warm job holds the only slot, so it steps aside at a chunk end and
    # is queued again (with more slots it shares the Conclave's turns instead).
    stack = stack_factory(cache=CACHE, n_ctx=2048, worker={"max_active_jobs": 1})
    document = INVOICE * 2  # ~500 tokens: several 64-token chunks of warm prefill
    run = HTTP.post(f"{stack.url}/v1/warm", json={"document": document, **_fields()}).json()
    warm_id = run["jobs"][0]["id"]
    wait_status(stack, warm_id, {"started"})
    job = submit(stack, {"prompt": "Say hi.", "max_tokens": 4, "temperature": 0})
    done = wait_status(stack, job["id"], {"finished"}, timeout_s=60)
    warm_job = HTTP.get(f"{stack.url}/v1/jobs/{warm_id}").json()
    # The interactive job ran while the warm job was still unfinished: it waited one chunk.
    assert warm_job["status"] in ("queued", "started"), warm_job
    assert done["started_at"] < (warm_job["finished_at"] or float("inf"))
    warm_job = wait_status(stack, warm_id, {"finished"}, timeout_s=300)
    assert warm_job["warm"]["yielded"] >= 1
    assert warm_job["warm"]["warmed_tokens"] == warm_job["warm"]["prefix_tokens"]
    assert ask(stack, document)["usage"]["cached_tokens"] == warm_job["warm"]["prefix_tokens"]


def _fields() -> dict[str, str]:
    return {"instructions": INSTRUCTIONS}


def test_learned_prefixes_are_rewarmed_after_eviction(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(cache=CACHE)
    ask(stack, INVOICE)
    reused = ask(stack, INVOICE, prompt="Which line has the most boxes?")["usage"]["cached_tokens"]
    assert reused > 0  # the second question found the document
    # Evicted: the cache is emptied, and the worker holds nothing in memory.
    stack.forget()
    _clear_cache(stack.settings)
    stack.start_warmer("--run-now")
    run = wait_for(lambda: finished_runs(stack), "the warm run")[-1]
    # The document's prefix: what the second question reused, but for any tokens its question
    # shared with the first's, where restores may end at any token.
    prefix = run["warmed_tokens"]
    assert run["counts"]["finished"] == 1 and 0 < prefix <= reused, run
    stack.forget()  # nothing in memory: only the disk can help
    assert ask(stack, INVOICE)["usage"]["cached_tokens"] == prefix


def _clear_cache(settings: Settings) -> None:
    for blob in settings.cache_dir.rglob("*"):
        if blob.is_file():
            blob.unlink()


def test_a_restarted_warmer_catches_up_once(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(workers=0, warmer={"schedule": "0 3 * * *"})
    client = redis.Redis.from_url(stack.settings.redis_url)
    three_days_ago = datetime.now().astimezone() - timedelta(days=3)
    client.set(keys.warmer_last_fire(), three_days_ago.isoformat())
    stack.start_warmer()
    runs = WarmRuns(client, JobStore(client, 60), stack.settings)
    # It logs that it started once its catch-up is decided (and run): one run, not two.
    wait_for(lambda: "warmer started" in stack.log("warmer"), "the warmer to start")
    first = runs.recent()
    assert [r.trigger for r in first] == ["catch-up"]
    # Restarted again: nothing was missed since the catch-up.
    stack.stop_process("warmer")
    stack.start_warmer(name="warmer-2")
    wait_for(lambda: "warmer started" in stack.log("warmer-2"), "the warmer to start again")
    assert [r.id for r in runs.recent()] == [first[0].id]
    assert isinstance(first[0], WarmRunView)


def test_granary_warm_cli_then_every_decoding_mode_hits(
    stack_factory: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = stack_factory(cache=CACHE)
    doc = tmp_path / "invoice.txt"
    doc.write_text(INVOICE, encoding="utf-8")
    command = [sys.executable, "-m", "cli.main", "warm", str(doc), "--instructions", INSTRUCTIONS]
    done = subprocess.run(
        command, env=settings_env(stack.settings), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    prefix = int(done.stdout.split(": ", 1)[1].split(" tokens")[0])
    assert f"{prefix} tokens, {prefix} computed" in done.stdout
    again = subprocess.run(
        command, env=settings_env(stack.settings), capture_output=True, text=True, timeout=300
    )
    assert f"{prefix} tokens, already cached" in again.stdout
    stack.forget()  # only the disk holds the document now
    # A different question each time: a repeated one would also restore its own tokens (the
    # later ones may also reuse the question words they share with the one before).
    modes = ({}, {"temperature": 0.8, "seed": 3}, {"speculation": "on"})
    for line, extra in enumerate(modes, start=1):
        answer = ask(stack, INVOICE, prompt=f"What is on line {line}?", **extra)
        assert prefix <= answer["usage"]["cached_tokens"] < answer["usage"]["prompt_tokens"] - 4
    body = {
        "document": INVOICE,
        "instructions": INSTRUCTIONS,
        "questions": [{"id": "a", "question": "Total?"}, {"id": "b", "question": "Lines?"}],
        "max_tokens": 4,
    }
    job = HTTP.post(f"{stack.url}/v1/extractions", json=body).json()
    assert wait_status(stack, job["id"], {"finished"}, 120)["usage"]["cached_tokens"] == prefix
