"""One worker serving many jobs at once (worker/conclave/), through the real job path."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.harness import HTTP, Stack
from tests.integration.test_job_path import (
    COUNTING,
    events,
    first_tokens,
    submit,
    wait_status,
)
from tests.integration.test_metrics import scrape

CHATS = [
    "Name three rivers in Europe.",
    "What is the boiling point of water in Fahrenheit?",
    "Write one sentence about autumn.",
    "Give me a synonym for 'quick'.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Italian.",
    "What colour do you get by mixing blue and yellow?",
    "Suggest a name for a grey cat.",
]


def chat(question: str, max_tokens: int = 32) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def finish_all(stack: Stack, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [wait_status(stack, j["id"], {"finished", "failed"}, timeout_s=300) for j in jobs]


def overlapped(views: list[dict[str, Any]]) -> bool:
    """Whether every job started before any of them finished: they really ran together."""
    return bool(max(v["started_at"] for v in views) < min(v["finished_at"] for v in views))


@pytest.mark.qwen
def test_greedy_qwen_chats_run_together_equal_their_lone_runs(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(model="qwen2.5-coder-0.5b", worker={"max_active_jobs": 8})
    lone = [finish_all(stack, [submit(stack, chat(q, 16))])[0] for q in CHATS]
    together = finish_all(stack, [submit(stack, chat(q, 16)) for q in CHATS])
    assert all(v["status"] == "finished" for v in lone + together)
    assert overlapped(together)
    for alone, beside in zip(lone, together, strict=True):
        assert beside["result"]["text"] == alone["result"]["text"]
    # ...because Qwen's rows decode beside others as alone, not by near-tie replays.
    assert "row check: batched rows equal lone rows" in stack.log("worker-1")


def test_cancelling_one_job_leaves_the_others_whole(stack: Stack) -> None:
    lone = finish_all(stack, [submit(stack, {**COUNTING, "max_tokens": 120})])[0]
    jobs = [submit(stack, {**COUNTING, "max_tokens": 120}) for _ in range(4)]
    for job in jobs:
        first_tokens(stack, job["id"], 3)
    assert scrape(stack)["granary_active_jobs{queue=interactive}"] == 4
    HTTP.delete(f"{stack.url}/v1/jobs/{jobs[1]['id']}")
    views = finish_all(stack, [j for i, j in enumerate(jobs) if i != 1])
    cancelled = wait_status(stack, jobs[1]["id"], {"cancelled"})
    assert cancelled["result"]["finish_reason"] == "cancelled"
    assert cancelled["usage"]["completion_tokens"] < 120
    for view in views:
        assert view["status"] == "finished"
        assert view["result"]["text"] == lone["result"]["text"]
        streamed = [d["text"] for e, _, d in events(stack, view["id"]) if e == "token"]
        assert "".join(streamed) == view["result"]["text"]


def test_killed_worker_with_four_active_jobs_all_finish_elsewhere(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prompts = [f"Count: {n}, {n + 1}, {n + 2}," for n in (1, 10, 100, 1000)]
    jobs = [submit(stack, {"prompt": p, "temperature": 0, "max_tokens": 80}) for p in prompts]
    for job in jobs:
        first_tokens(stack, job["id"], 5)
    # Killed before the second worker starts: while a model loads, the first worker could
    # finish a job (it did on a fast host: attempts 1).
    stack.kill("worker-1")
    stack.start_worker("worker-2")
    for job in jobs:
        final = wait_status(stack, job["id"], {"finished", "failed"}, timeout_s=120)
        assert final["status"] == "finished", final
        assert final["attempts"] == 2
        assert final["usage"]["completion_tokens"] == 80
        assert final["usage"]["resumed_tokens"] >= 5
        tokens = [d for e, _, d in events(stack, job["id"]) if e == "token"]
        assert [t["index"] for t in tokens] == list(range(len(tokens)))
        assert "".join(t["text"] for t in tokens) == final["result"]["text"]


def test_a_job_without_room_waits_in_redis_and_interactive_goes_before_batch(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(worker={"max_active_jobs": 2})
    # As long as a sequence allows (n_ctx 1024): they must not end before they are cancelled,
    # and with both rows in one pass two 400-token jobs could end while the test looks.
    busy = [submit(stack, {**COUNTING, "max_tokens": 960}) for _ in range(2)]
    for job in busy:
        first_tokens(stack, job["id"], 1)
    item = {"document": "The shop opens at 9.", "questions": [{"id": "q", "question": "When?"}]}
    batch = HTTP.post(f"{stack.url}/v1/batches", json={"items": [{"custom_id": "a", **item}]})
    assert batch.status_code == 202, batch.text
    results = HTTP.get(f"{stack.url}/v1/batches/{batch.json()['id']}/results").text
    batch_job = orjson.loads(results.splitlines()[0])["job_id"]
    # Long too: had it ended before the look below, the batch job would have taken its slot.
    late = submit(stack, {**COUNTING, "max_tokens": 960})
    # Both slots are taken: the two wait in Redis, not in the worker.
    assert HTTP.get(f"{stack.url}/v1/jobs/{late['id']}").json()["status"] == "queued"
    assert HTTP.get(f"{stack.url}/v1/jobs/{batch_job}").json()["status"] == "queued"
    HTTP.delete(f"{stack.url}/v1/jobs/{busy[0]['id']}")
    # The interactive job, queued after the batch one, takes the freed slot.
    assert wait_status(stack, late["id"], {"started", "finished"})["status"] == "started"
    assert HTTP.get(f"{stack.url}/v1/jobs/{batch_job}").json()["status"] == "queued"
    for job in (late, busy[1]):
        HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")
    assert wait_status(stack, batch_job, {"finished"}, timeout_s=120)["status"] == "finished"


def test_a_short_prompt_is_not_stuck_behind_a_long_prefill(
    stack_factory: Callable[..., Stack],
) -> None:
    # Small chunks: the long prompt takes many turns of the loop to read.
    stack = stack_factory(cache={"enabled": False, "block_tokens": 32})
    long_prompt = "The inventory lists crates, barrels and sacks of grain. " * 32
    long = submit(stack, {"prompt": long_prompt, "temperature": 0, "max_tokens": 1})
    wait_status(stack, long["id"], {"started", "finished"})
    short = submit(stack, {"prompt": "Hello", "temperature": 0, "max_tokens": 1})
    long_view, short_view = finish_all(stack, [long, short])
    assert long_view["usage"]["prompt_tokens"] > 10 * 32  # ten turns or more
    assert short_view["finished_at"] < long_view["finished_at"]


def test_a_stop_asked_while_a_job_runs_ends_the_worker_when_the_job_ends(
    stack_factory: Callable[..., Stack],
) -> None:
    # The default heartbeat: rq's dequeue then waits 30 s on Redis, which a stop asked while
    # the worker was busy used to sit out after its last job.
    stack = stack_factory(worker={"heartbeat_ttl_s": 30})
    job = submit(stack, {**COUNTING, "max_tokens": 40})
    first_tokens(stack, job["id"], 1)
    worker = stack.procs["worker-1"]
    worker.terminate()  # SIGTERM: finish the running job, then stop
    assert wait_status(stack, job["id"], {"finished"})["status"] == "finished"
    ended = time.monotonic()
    worker.wait(timeout=20)
    assert time.monotonic() - ended < 8
