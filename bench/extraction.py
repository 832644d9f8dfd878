"""One document, sixteen questions: an extraction job versus answering them one by one.

Four ways to answer 16 short questions about one ~3000-token document, wall time of each
(submission to last answer), side by side in one run:
- granary extraction: one `POST /v1/extractions` job (one prefill, answers decoded together);
- 16 cold jobs: one document job per question, each on a freshly started worker with the cache
  off, so each computes the whole document (what a server without prefix reuse pays);
- 16 jobs through granary's cache: the same jobs one after another on one worker, cache on;
- llama-cpp-python's packaged OpenAI server (`python -m llama_cpp.server`, `--cache true`, its
  RAM prefix cache, otherwise defaults) answering the same 16 chat requests one by one.
Greedy everywhere; the answers of each way are compared with the cold jobs'.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.prefix_cache import document
from shared.models import resolve_model
from shared.settings import Settings
from tests.harness import Stack, _get_ok, _wait_for, free_port

INSTRUCTIONS = "Answer questions about this purchase order ledger in a few words."
QUESTIONS = [f"What is the status of line {i * 5}?" for i in range(8)] + [
    f"How many units are on line {i * 5 + 2}?" for i in range(8)
]
MAX_TOKENS = 12


@dataclass(frozen=True, slots=True)
class Way:
    label: str
    seconds: float
    answers: list[str]


def _doc() -> str:
    return document(90, seed=4242).rsplit("\n", 1)[0]


def _job(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    job_id = client.post("/v1/jobs" if "prompt" in body else "/v1/extractions", json=body).json()[
        "id"
    ]
    while (view := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "started"):
        time.sleep(0.1)
    assert view["status"] == "finished", view
    result: dict[str, Any] = view
    return result


def _question_body(doc: str, question: str) -> dict[str, Any]:
    return {
        "document": doc,
        "document_format": "raw",  # as in earlier runs: this measures restores and answering
        "instructions": INSTRUCTIONS,
        "prompt": question,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def _extraction(stack: Stack, doc: str) -> Way:
    body = {
        "document": doc,
        "document_format": "raw",  # as in earlier runs: this measures restores and answering
        "instructions": INSTRUCTIONS,
        "questions": [{"id": str(i), "question": q} for i, q in enumerate(QUESTIONS)],
        "max_tokens": MAX_TOKENS,
    }
    with httpx.Client(base_url=stack.url, timeout=900) as client:
        started = time.perf_counter()
        view = _job(client, body)
    answers = view["extraction"]["answers"]
    return Way(
        "granary extraction job",
        time.perf_counter() - started,
        [answers[str(i)]["text"] for i in range(len(QUESTIONS))],
    )


def _one_by_one(stack: Stack, doc: str, label: str, restart: bool) -> Way:
    seconds, answers, worker = 0.0, [], 0
    with httpx.Client(base_url=stack.url, timeout=900) as client:
        for question in QUESTIONS:
            if restart:  # a fresh process: nothing in memory either
                stack.stop_process(f"worker-{worker}")
                worker += 1
                stack.start_worker(f"worker-{worker}")
            started = time.perf_counter()
            answers.append(_job(client, _question_body(doc, question))["result"]["text"])
            seconds += time.perf_counter() - started
    return Way(label, seconds, answers)


def _peer_server(settings: Settings, log_dir: Path, doc: str) -> Way:
    port = free_port()
    model = resolve_model(settings.model, settings.data_dir)
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--n_ctx",
        str(settings.n_ctx),
        "--n_threads",
        str(settings.threads),
        "--n_threads_batch",
        str(settings.threads),
        "--cache",
        "true",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log_path = log_dir / "llama_cpp_server.log"
    server = subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _get_ok(f"http://127.0.0.1:{port}/v1/models"), "llama_cpp.server", 120)
        seconds, answers = 0.0, list[str]()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
            for question in QUESTIONS:
                messages = [
                    {"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": f"{doc}\n\n{question}"},
                ]
                body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
                started = time.perf_counter()
                try:
                    reply = client.post("/v1/chat/completions", json=body).json()
                except httpx.HTTPError as exc:  # kept as a result: the peer failed here
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                    label = f"llama_cpp.server FAILED at question {len(answers) + 1}: {exc}; {tail}"
                    return Way(label, seconds, answers + [""] * (len(QUESTIONS) - len(answers)))
                seconds += time.perf_counter() - started
                answers.append(reply["choices"][0]["message"]["content"])
    finally:
        server.terminate()
        server.wait(timeout=30)
    return Way("llama_cpp.server, RAM cache on, one by one", seconds, answers)


def _cache(settings: Settings, **changes: object) -> Settings:
    return settings.model_copy(update={"cache": settings.cache.model_copy(update=changes)})


def _on_stack(settings: Settings, log_dir: Path, measure: Callable[[Stack], Way]) -> Way:
    stack = Stack(settings, log_dir)
    try:
        stack.start_api()
        stack.start_worker("worker-0")
        return measure(stack)
    finally:
        stack.stop()


def section(settings: Settings, log_dir: Path) -> str:
    doc = _doc()
    ways = [
        _on_stack(
            _cache(settings, enabled=False),
            log_dir,
            lambda s: _one_by_one(s, doc, "16 independent cold jobs", restart=True),
        ),
        _on_stack(
            _cache(settings, dir=log_dir / "kv-extraction"),
            log_dir,
            lambda s: _extraction(s, doc),
        ),
        _on_stack(
            _cache(settings, dir=log_dir / "kv-one-by-one"),
            log_dir,
            lambda s: _one_by_one(s, doc, "16 jobs through granary's cache", restart=False),
        ),
        _peer_server(settings, log_dir, doc),
    ]
    return _render(settings, ways)


def _render(settings: Settings, ways: list[Way]) -> str:
    by_label = {w.label: w for w in ways}
    extraction = by_label["granary extraction job"]
    reference = by_label["16 independent cold jobs"]
    rows = []
    for way in ways:
        same = sum(
            a.strip() == b.strip() for a, b in zip(way.answers, reference.answers, strict=True)
        )
        rows.append(
            f"| {way.label} | {way.seconds:.1f} | {way.seconds / extraction.seconds:.1f}× | "
            f"{same}/{len(QUESTIONS)} |"
        )
    cold_x = reference.seconds / extraction.seconds
    peer = ways[-1]
    peer_x = peer.seconds / extraction.seconds
    if peer.answers[-1]:
        peer_verdict = f"{'met' if peer_x >= 2 else 'MISSED'}"
    else:  # it failed part-way: the time it spent before failing is a lower bound
        peer_verdict = f"peer did not finish; {'met' if peer_x >= 2 else 'not shown'} as a bound"
    verdict = (
        f"extraction is **{cold_x:.1f}×** faster than independent cold jobs (target ≥ 8×: "
        f"{'met' if cold_x >= 8 else 'MISSED'}) and **{peer_x:.1f}×** faster than llama_cpp.server "
        f"with its cache (target ≥ 2×: {peer_verdict})"
    )
    return f"""## Extraction: one document, sixteen questions

{settings.model}, {settings.threads} threads, n_ctx {settings.n_ctx}: one ~3000-token ledger
document, {len(QUESTIONS)} short questions, greedy, at most {MAX_TOKENS} answer tokens each.
Wall time from the first request to the last answer (worker restarts between cold jobs are not
counted). "Same answers" compares each way's answers with the cold jobs' (answering together
decodes every question's row in one pass, each row computed as alone, so they must match; the
peer renders its chat prompt slightly differently, so it asks a slightly different question).
Result: {verdict}.

| way | wall s | × extraction's time | same answers as cold jobs |
|---|---|---|---|
{chr(10).join(rows)}
"""
