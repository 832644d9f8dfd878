"""Voted extraction answers (`samples`) through the whole stack: real processes, Redis, model.

Sample s of question i is the job a client would send alone: the same prompt, greedy for
sample 0, else `temperature` with seed + i + s x questions. So the votes are checked against
answers computed one job at a time.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import HTTP, Stack, settings_env
from tests.integration.test_extraction import (
    CACHE,
    INSTRUCTIONS,
    INVOICE,
    QUESTIONS,
    extraction,
    stream,
)
from tests.integration.test_job_path import first_tokens, submit, wait_status
from tests.integration.test_result_cache import stored, wait_stored
from worker.answer_key import answer_key

SAMPLES, TEMPERATURE, SEED = 5, 1.0, 11
VOTE = {"samples": SAMPLES, "temperature": TEMPERATURE, "seed": SEED, "max_tokens": 12}


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    return module_stack_factory(cache=CACHE, result_cache={"enabled": True})


def finished(stack: Stack, job: dict[str, Any]) -> dict[str, Any]:
    final = wait_status(stack, job["id"], {"finished", "failed", "cancelled"}, timeout_s=300)
    assert final["status"] == "finished", final
    return final


def one_job_per_sample(stack: Stack, questions: list[str]) -> list[list[str]]:
    """Every sample of every question as a job of its own: texts[question][sample]."""
    jobs = [
        [
            submit(
                stack,
                {
                    "document": INVOICE,
                    "instructions": INSTRUCTIONS,
                    "prompt": question,
                    "max_tokens": VOTE["max_tokens"],
                    "temperature": 0 if s == 0 else TEMPERATURE,
                    "seed": SEED + i + s * len(questions),
                    "cache": False,
                },
            )
            for s in range(SAMPLES)
        ]
        for i, question in enumerate(questions)
    ]
    return [[finished(stack, job)["result"]["text"] for job in row] for row in jobs]


def majority(texts: list[str]) -> set[str]:
    """The full count's winner, written plainly: its spellings, of the answer with most votes
    (ties to the lowest sample)."""
    keys = [answer_key(t) for t in texts]
    votes = Counter(keys)
    best = next(k for k in keys if votes[k] == max(votes.values()))
    return {t for t in texts if answer_key(t) == best}


def answers(final: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    return {q: (a["text"], a["vote"]) for q, a in final["extraction"]["answers"].items()}


def test_a_vote_is_the_majority_of_its_samples_and_reproduces(stack: Stack) -> None:
    questions = QUESTIONS[:2]
    first = finished(stack, extraction(stack, questions, **VOTE, cache=False))
    alone = one_job_per_sample(stack, questions)
    for i, texts in enumerate(alone):
        answer = first["extraction"]["answers"][f"q{i}"]
        assert answer["text"] in majority(texts), (answer, texts)
        vote = answer["vote"]
        assert vote["samples"] == SAMPLES and 0 < vote["counted"] <= SAMPLES
        assert vote["agreement"] == vote["variants"][0]["votes"] / vote["counted"]
        assert vote["variants"][0]["text"] == answer["text"]
        for variant in vote["variants"]:  # each counted sample is its own job's answer
            same = [t for t in texts if answer_key(t) == answer_key(variant["text"])]
            assert variant["text"] in same and variant["votes"] <= len(same)
        assert answer["usage"]["completion_tokens"] > 0
    again = finished(stack, extraction(stack, questions, **VOTE, cache=False))
    assert answers(again) == answers(first)
    # Seeded, a vote is stored as the request's result; another number of samples is not it.
    before = stored(stack)
    kept = finished(stack, extraction(stack, questions, **VOTE))
    assert answers(kept) == answers(first) and not kept["usage"]["cached_result"]
    wait_stored(stack, before + 1)
    assert finished(stack, extraction(stack, questions, **VOTE))["usage"]["cached_result"]
    fewer = finished(stack, extraction(stack, questions, **{**VOTE, "samples": 3}))
    assert not fewer["usage"]["cached_result"]
    assert all(a["vote"]["samples"] == 3 for a in fewer["extraction"]["answers"].values())
    metrics = HTTP.get(f"{stack.url}/metrics").text
    voted = next(line for line in metrics.splitlines() if line.startswith("granary_voted_answers"))
    assert float(voted.split()[-1]) >= 8


def test_a_vote_streams_the_greedy_sample_and_answers_with_the_winner(stack: Stack) -> None:
    job = extraction(stack, QUESTIONS[:2], **VOTE, cache=False, instructions="Answer briefly.")
    events = stream(stack, job["id"])
    final = events[-1][1]
    greedy: dict[str, str] = {}
    for event, data in events:
        if event == "token":
            greedy[data["question"]] = greedy.get(data["question"], "") + data["text"]
    answered = {data["question"]: data["answer"] for event, data in events if event == "answer"}
    assert answered == final["extraction"]["answers"]
    for qid, answer in answered.items():
        texts = [v["text"] for v in answer["vote"]["variants"]]
        # Sample 0 was counted unless the vote was decided without it.
        assert greedy[qid] in texts or answer["vote"]["counted"] < SAMPLES


def test_samples_need_a_temperature_and_a_bound(stack: Stack) -> None:
    body = {
        "document": INVOICE,
        "questions": [{"id": "a", "question": "Sum?"}],
        "samples": 3,
    }
    response = HTTP.post(f"{stack.url}/v1/extractions", json=body)
    assert response.status_code == 400 and "temperature" in response.text, response.text
    for samples in (0, 17):
        response = HTTP.post(
            f"{stack.url}/v1/extractions", json={**body, "samples": samples, "temperature": 1}
        )
        assert response.status_code == 400 and "samples" in response.text, response.text
    many = [{"id": f"q{i}", "question": "Sum?"} for i in range(100)]
    response = HTTP.post(
        f"{stack.url}/v1/extractions",
        json={**body, "questions": many, "samples": 16, "temperature": 1},
    )
    assert response.status_code == 400 and "1024" in response.text, response.text


def test_cancelling_a_vote_ends_every_sample(stack: Stack) -> None:
    long = {**VOTE, "max_tokens": 200, "cache": False}
    job = extraction(stack, ["Copy the whole invoice, line by line."], **long)
    first_tokens(stack, job["id"], 4)
    assert HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    final = wait_status(stack, job["id"], {"cancelled"}, timeout_s=60)
    answer = final["extraction"]["answers"]["q0"] if final["extraction"] else None
    assert answer is None or answer["finish_reason"] == "cancelled"
    # The worker is free again: a vote after it finishes.
    finished(stack, extraction(stack, QUESTIONS[:1], **VOTE, cache=False))


def test_extract_command_prints_the_agreement(stack: Stack, tmp_path: Path) -> None:
    doc = tmp_path / "invoice.txt"
    doc.write_text(INVOICE, encoding="utf-8")
    command = [sys.executable, "-m", "cli.main", "extract", str(doc), "--question", QUESTIONS[0]]
    command += ["--samples", "3", "--temperature", "1", "--seed", "5"]
    done = subprocess.run(
        command, env=settings_env(stack.settings), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "agreement 1: " in done.stderr and " of " in done.stderr, done.stderr


def test_a_killed_worker_mid_vote_gives_the_uninterrupted_vote(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(cache=CACHE)
    questions = ["Copy the whole invoice, line by line.", QUESTIONS[0]]
    body = {**VOTE, "samples": 3, "max_tokens": 40, "cache": False}
    whole = finished(stack, extraction(stack, questions, **body))
    job = extraction(stack, questions, **body)
    first_tokens(stack, job["id"], 6)
    stack.kill("worker-1")
    stack.start_worker("worker-2")
    final = finished(stack, job)
    assert final["attempts"] == 2
    assert answers(final) == answers(whole)


def test_voted_questions_beyond_the_sequences_each_get_their_vote(stack: Stack) -> None:
    """14 questions x 3 samples, more streams than the worker has sequences: later samples
    are drawn as votes stay open, and every question is answered by its vote."""
    questions = [f"How many boxes are on line {i}?" for i in range(14)]
    body = {**VOTE, "samples": 3, "max_tokens": 6, "cache": False}
    final = finished(stack, extraction(stack, questions, **body))
    for answer in final["extraction"]["answers"].values():
        assert 2 <= answer["vote"]["counted"] <= 3
        assert answer["finish_reason"] in ("stop", "length")
