"""Extraction and batch jobs through the whole stack: real processes, Redis and models."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from httpx_sse import connect_sse

from tests.harness import HTTP, Stack, settings_env
from tests.integration.test_job_path import first_tokens, is_keepalive, submit, wait_status

INSTRUCTIONS = "Answer from the invoice only, in a few words."
INVOICE = " ".join(
    f"Line {i}: {i * 3 % 17} boxes of {['tea', 'rice', 'salt'][i % 3]} for shop {i % 4}."
    for i in range(24)
)
QUESTIONS = [
    "Which product is on line 5?",
    "How many boxes are on line 7?",
    "Which shop gets line 10?",
    "What is sold on line 2?",
]
CACHE = {"block_tokens": 64, "min_tokens": 16}


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack for the module's tests that take `stack`: they only send extractions and
    batches and read their own results (a test that needs a document no one has read brings
    its own instructions)."""
    return module_stack_factory(cache=CACHE)


def extraction(stack: Stack, questions: list[str], **extra: Any) -> dict[str, Any]:
    body = {
        "document": INVOICE,
        "instructions": INSTRUCTIONS,
        "questions": [{"id": f"q{i}", "question": q} for i, q in enumerate(questions)],
        "max_tokens": 12,
        **extra,
    }
    response = HTTP.post(f"{stack.url}/v1/extractions", json=body)
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def stream(stack: Stack, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    with (
        httpx.Client(timeout=300) as client,
        connect_sse(client, "GET", f"{stack.url}/v1/jobs/{job_id}/events") as source,
    ):
        for sse in source.iter_sse():
            if is_keepalive(sse):
                continue
            out.append((sse.event, orjson.loads(sse.data)))
            if sse.event in ("done", "error"):
                break
    return out


def alone(stack: Stack, question: str) -> str:
    body = {
        "document": INVOICE,
        "instructions": INSTRUCTIONS,
        "prompt": question,
        "max_tokens": 12,
        "temperature": 0,
    }
    job = wait_status(stack, submit(stack, body)["id"], {"finished"}, timeout_s=300)
    text: str = job["result"]["text"]
    return text


@pytest.mark.qwen
def test_answers_equal_one_question_jobs_and_stream_tagged(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(model="qwen2.5-coder-0.5b", cache=CACHE)
    events = stream(stack, extraction(stack, QUESTIONS)["id"])
    final = events[-1][1]
    assert events[-1][0] == "done" and final["status"] == "finished", final
    answers = final["extraction"]["answers"]
    assert list(answers) == ["q0", "q1", "q2", "q3"]
    # Tokens are tagged with their question; one `answer` event per question, as it completes.
    by_question: dict[str, str] = {}
    for event, data in events:
        if event == "token":
            by_question[data["question"]] = by_question.get(data["question"], "") + data["text"]
    answered = [data for event, data in events if event == "answer"]
    assert sorted(a["question"] for a in answered) == ["q0", "q1", "q2", "q3"]
    for qid, answer in answers.items():
        assert by_question[qid] == answer["text"]
        assert answer["usage"]["completion_tokens"] > 0
    usage = final["usage"]
    assert usage["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in answers.values()
    )
    # Decoded four at a time, near ties decided alone: each answer is its own job's.
    for i, question in enumerate(QUESTIONS):
        assert answers[f"q{i}"]["text"] == alone(stack, question), question


def test_killed_worker_extraction_carries_on_from_its_stream(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    questions = ["Copy the whole invoice, line by line.", "Which product is on line 5?"]
    job = extraction(stack, questions, max_tokens=120, temperature=0)
    first_tokens(stack, job["id"], 8)
    stack.kill("worker-1")
    stack.start_worker("worker-2")
    final = wait_status(stack, job["id"], {"finished", "failed"}, timeout_s=120)
    assert final["status"] == "finished", final
    assert final["attempts"] == 2
    assert final["usage"]["resumed_tokens"] >= 8
    seen = stream(stack, job["id"])
    assert [data["index"] for event, data in seen if event != "done"] == list(range(len(seen) - 1))
    answers = final["extraction"]["answers"]
    for qid, answer in answers.items():
        texts = [
            data["text"] for event, data in seen if event == "token" and data["question"] == qid
        ]
        assert "".join(texts) == answer["text"]
        assert sum(event == "answer" and data["question"] == qid for event, data in seen) == 1


@pytest.mark.qwen
def test_questions_beyond_the_context_run_in_waves(stack_factory: Callable[..., Stack]) -> None:
    # ~330 document tokens; each question needs ~20 + 200: three do not fit in 768 at once.
    stack = stack_factory(model="qwen2.5-coder-0.5b", n_ctx=768, cache=CACHE)
    job = extraction(stack, QUESTIONS[:3], max_tokens=200, stop=["\n", "."])
    final = wait_status(stack, job["id"], {"finished", "failed"}, timeout_s=300)
    assert final["status"] == "finished", final
    for i, question in enumerate(QUESTIONS[:3]):
        answer = final["extraction"]["answers"][f"q{i}"]["text"]
        single = submit(
            stack,
            {
                "document": INVOICE,
                "instructions": INSTRUCTIONS,
                "prompt": question,
                "max_tokens": 200,
                "temperature": 0,
                "stop": ["\n", "."],
            },
        )
        assert answer == wait_status(stack, single["id"], {"finished"}, 300)["result"]["text"]


def test_sixteen_questions_and_fields(stack: Stack) -> None:
    # Instructions of its own: the system message comes first, so nothing here was read before.
    instructions = "Read the invoice, then answer in a few words."
    questions = [f"How many boxes are on line {i}?" for i in range(16)]
    job = extraction(stack, questions, max_tokens=6, instructions=instructions)
    final = wait_status(stack, job["id"], {"finished"}, 300)
    assert len(final["extraction"]["answers"]) == 16
    assert final["usage"]["cached_tokens"] == 0
    fields = {"product_line_3": "the product on line 3", "shop_line_3": "the shop of line 3"}
    body = {"document": INVOICE, "instructions": instructions, "fields": fields, "max_tokens": 6}
    job = HTTP.post(f"{stack.url}/v1/extractions", json=body).json()
    final = wait_status(stack, job["id"], {"finished"}, 300)
    assert set(final["extraction"]["object"]) == set(fields)
    assert final["usage"]["cached_tokens"] > 0  # the document, from the first extraction


def test_a_request_that_cannot_fit_is_refused_with_the_overflow(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(workers=0, n_ctx=512)
    body = {"document": INVOICE, "questions": [{"id": "a", "question": "Sum?"}], "max_tokens": 400}
    response = HTTP.post(f"{stack.url}/v1/extractions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "context_length_exceeded"
    assert (
        "'a' does not fit" in error["message"]
        and "more than the context window (512)" in error["message"]
    )
    for bad in (
        {"document": INVOICE},
        {"document": INVOICE, "questions": [], "fields": {"a": "b"}},
        {
            "document": INVOICE,
            "questions": [{"id": "a", "question": "x"}, {"id": "a", "question": "y"}],
        },
        {"questions": [{"id": "a", "question": "x"}]},
    ):
        assert HTTP.post(f"{stack.url}/v1/extractions", json=bad).status_code == 400, bad


def batch_items(n: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"item-{i}",
            "document": INVOICE,
            "instructions": INSTRUCTIONS,
            "questions": [{"id": "q", "question": QUESTIONS[i % 4]}],
            "max_tokens": 4,
        }
        for i in range(n)
    ]


def test_a_batch_counts_results_and_isolates_failures(stack: Stack) -> None:
    items = batch_items(3)
    items.insert(1, {**items[0], "custom_id": "too-long", "document": INVOICE * 6})
    batch = HTTP.post(f"{stack.url}/v1/batches", json={"items": items}).json()
    assert batch["total"] == 4 and batch["counts"]["failed"] == 1
    deadline = time.monotonic() + 300
    while batch["finished_at"] is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
        batch = HTTP.get(f"{stack.url}/v1/batches/{batch['id']}").json()
    assert batch["counts"] == {
        "queued": 0,
        "running": 0,
        "succeeded": 3,
        "failed": 1,
        "cancelled": 0,
    }
    lines = HTTP.get(f"{stack.url}/v1/batches/{batch['id']}/results").text.splitlines()
    results = [orjson.loads(line) for line in lines]
    assert [r["custom_id"] for r in results] == ["item-0", "too-long", "item-1", "item-2"]
    assert results[1]["status"] == "failed" and "does not fit" in results[1]["error"]
    assert all(
        r["extraction"]["answers"]["q"]["text"] for r in results if r["status"] == "finished"
    )
    # The items share a document: all but the first restored it.
    assert sum(r["usage"]["cached_tokens"] > 0 for r in results if r["status"] == "finished") >= 2


def test_cancelling_a_batch_keeps_finished_items(stack: Stack) -> None:
    batch = HTTP.post(f"{stack.url}/v1/batches", json={"items": batch_items(12)}).json()
    url = f"{stack.url}/v1/batches/{batch['id']}"
    deadline = time.monotonic() + 300
    while HTTP.get(url).json()["counts"]["succeeded"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelled = HTTP.delete(url).json()
    assert cancelled["counts"]["succeeded"] >= 1 and cancelled["counts"]["cancelled"] >= 1
    final = HTTP.get(url).json()
    while final["finished_at"] is None:  # a running item stops within a token
        time.sleep(0.2)
        final = HTTP.get(url).json()
    assert final["counts"]["queued"] == final["counts"]["running"] == 0
    results = [orjson.loads(line) for line in HTTP.get(f"{url}/results").text.splitlines()]
    finished = [r for r in results if r["status"] == "finished"]
    assert len(finished) == final["counts"]["succeeded"] >= 1
    assert all(r["extraction"] is not None for r in finished)
    assert HTTP.get(f"{stack.url}/v1/batches/nope").status_code == 404


def test_extract_and_batch_commands(stack: Stack, tmp_path: Path) -> None:
    env = settings_env(stack.settings)
    doc = tmp_path / "invoice.txt"
    doc.write_text(INVOICE, encoding="utf-8")
    cli = [sys.executable, "-m", "cli.main"]
    extract = [*cli, "extract", str(doc), "--question", QUESTIONS[0], "--question", QUESTIONS[1]]
    done = subprocess.run(extract, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert set(orjson.loads(done.stdout)) == {"1", "2"}
    assert "2/2" in done.stderr  # the progress bar reached every answer
    items = tmp_path / "items.jsonl"
    items.write_bytes(b"\n".join(orjson.dumps(item) for item in batch_items(3)))
    out = tmp_path / "results.jsonl"
    done = subprocess.run(
        [*cli, "batch", str(items), "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["custom_id"] for r in results] == ["item-0", "item-1", "item-2"]
    assert all(r["status"] == "finished" for r in results)
