"""HTTP -> Redis/rq -> resident worker -> SSE, with real processes, Redis and SmolLM2."""

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
from httpx_sse import ServerSentEvent, connect_sse

from tests.harness import HTTP, Stack

# Greedy and long-winded: SmolLM2 keeps counting well past any max_tokens used here.
COUNTING = {"prompt": "Count: 1, 2, 3, 4, 5, 6, 7, 8,", "temperature": 0}


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack (one worker) for the module's tests that take `stack`: each follows its own
    jobs to their end, so the next test finds the worker idle."""
    return module_stack_factory()


def submit(stack: Stack, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = HTTP.post(f"{stack.url}/v1/jobs", json=body, headers=headers)
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def is_keepalive(sse: ServerSentEvent) -> bool:
    """The API's `: ping` comment, which httpx-sse delivers as an empty "message" once an event
    id has been seen."""
    return sse.event == "message" and not sse.data


def events(
    stack: Stack, job_id: str, last_event_id: str | None = None
) -> list[tuple[str, str, dict[str, Any]]]:
    """Every (event, id, data) of the job's SSE stream, up to and including the final one."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    out = []
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "GET", f"{stack.url}/v1/jobs/{job_id}/events", headers=headers) as src,
    ):
        for sse in src.iter_sse():
            if is_keepalive(sse):
                continue
            assert sse.data, (sse.event, sse.id, sse.retry)
            out.append((sse.event, sse.id, orjson.loads(sse.data)))
            if sse.event in ("done", "error"):
                break
    return out


def wait_status(
    stack: Stack, job_id: str, statuses: set[str], timeout_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        response = HTTP.get(f"{stack.url}/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, f"job stayed {job['status']}"
        time.sleep(0.05)


def first_tokens(stack: Stack, job_id: str, count: int) -> None:
    """Block until the job has streamed `count` tokens (so it is certainly running)."""
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "GET", f"{stack.url}/v1/jobs/{job_id}/events") as src,
    ):
        tokens = (sse for sse in src.iter_sse() if not is_keepalive(sse))
        for seen, sse in enumerate(tokens, start=1):
            assert sse.event == "token", sse.data
            if seen >= count:
                return


def test_prompt_job_streams_tokens_then_done(stack: Stack) -> None:
    job = submit(stack, {**COUNTING, "max_tokens": 12})
    assert job["status"] == "queued"
    stream = events(stack, job["id"])
    tokens = [data for event, _, data in stream if event == "token"]
    final_event, _, final = stream[-1]
    assert final_event == "done"
    assert final["status"] == "finished"
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert "".join(t["text"] for t in tokens) == final["result"]["text"]
    assert final["usage"]["completion_tokens"] == 12
    assert final["result"]["finish_reason"] == "length"
    assert final["usage"]["prompt_tokens"] > 10
    for name in ("queued_ms", "prefill_ms", "ttft_ms", "decode_tokens_per_s"):
        assert final["timings"][name] is not None and final["timings"][name] >= 0, name
    assert HTTP.get(f"{stack.url}/v1/jobs/{job['id']}").json() == final


def test_a_job_whose_first_sample_ends_it_has_a_time_to_first_token(stack: Stack) -> None:
    """Its time to first token is the time to that decision (it was null: no token came)."""
    # SmolLM2 ends its turn right after a finished reply (greedy: jobs sample at 0.8 by default).
    said = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK."
    body = {"prompt": said, "special_tokens": True, "max_tokens": 8, "temperature": 0}
    job = submit(stack, body)
    final = wait_status(stack, job["id"], {"finished"})
    assert final["usage"]["completion_tokens"] == 0, "the model went on: pick another prompt"
    assert final["result"]["finish_reason"] == "stop"
    assert final["timings"]["ttft_ms"] is not None and final["timings"]["ttft_ms"] > 0
    assert final["timings"]["prefill_ms"] is not None


def test_chat_messages_use_the_template(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}
    final = events(stack, submit(stack, body)["id"])[-1][2]
    assert final["status"] == "finished"
    # SmolLM2's template adds its default system prompt: far more tokens than the message.
    assert final["usage"]["prompt_tokens"] > 20
    assert final["result"]["text"]


def test_same_seed_same_text_and_stop_sequence(stack: Stack) -> None:
    body = {**COUNTING, "max_tokens": 16}
    first = events(stack, submit(stack, body)["id"])[-1][2]["result"]["text"]
    again = events(stack, submit(stack, body)["id"])[-1][2]
    assert again["result"]["text"] == first
    # A prompt shared with the previous job re-uses the worker's in-memory cells.
    assert again["usage"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    stop = first.strip().split(",")[2].strip()  # a number the model will write
    stopped = events(stack, submit(stack, {**body, "stop": [stop]})["id"])[-1][2]
    assert stopped["result"]["finish_reason"] == "stop"
    assert stopped["result"]["text"] == first[: first.index(stop)]


def test_late_subscriber_and_reconnect_miss_nothing(stack: Stack) -> None:
    job = submit(stack, {**COUNTING, "max_tokens": 10})
    final = wait_status(stack, job["id"], {"finished"})
    late = events(stack, job["id"])
    tokens = [data for event, _, data in late if event == "token"]
    assert len(tokens) == 10
    assert "".join(t["text"] for t in tokens) == final["result"]["text"]
    # "\r\n" split across reads made httpx-sse deliver events without data: only "\n".
    raw = HTTP.get(f"{stack.url}/v1/jobs/{job['id']}/events").content
    assert b"\r" not in raw and raw.count(b"event: token\n") == 10
    resumed = events(stack, job["id"], last_event_id="6")
    assert [data["index"] for event, _, data in resumed if event == "token"] == [7, 8, 9]
    assert resumed[-1][0] == "done"


def test_cancel_running_job_stops_within_a_few_tokens(stack: Stack) -> None:
    job = submit(stack, {**COUNTING, "max_tokens": 600})
    first_tokens(stack, job["id"], 3)
    response = HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")
    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    stream = events(stack, job["id"])
    final = stream[-1][2]
    assert stream[-1][0] == "done"
    assert final["status"] == "cancelled"
    # Stopped well before max_tokens: the worker checks the flag with every token.
    assert final["usage"]["completion_tokens"] < 300
    assert final["result"]["finish_reason"] == "cancelled"


def test_cancel_queued_job_never_runs(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(worker={"max_active_jobs": 2})
    # Both of the worker's slots are taken: the third job waits in the queue.
    busy = [submit(stack, {**COUNTING, "max_tokens": 200}) for _ in range(2)]
    queued = submit(stack, {**COUNTING, "max_tokens": 5})
    for job in busy:
        first_tokens(stack, job["id"], 1)
    cancelled = HTTP.delete(f"{stack.url}/v1/jobs/{queued['id']}").json()
    assert cancelled["status"] == "cancelled"
    assert events(stack, queued["id"])[-1][2]["status"] == "cancelled"
    for job in busy:
        HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")
        wait_status(stack, job["id"], {"cancelled"})
    # The worker moves on past the cancelled job without running it.
    after = submit(stack, {**COUNTING, "max_tokens": 2})
    assert events(stack, after["id"])[-1][2]["status"] == "finished"
    job = HTTP.get(f"{stack.url}/v1/jobs/{queued['id']}").json()
    assert job["attempts"] == 0 and job["result"] is None


def test_idempotency_key_returns_the_same_job(stack: Stack) -> None:
    body = {**COUNTING, "max_tokens": 3}
    first = submit(stack, body, **{"Idempotency-Key": "order-42"})
    second = submit(stack, body, **{"Idempotency-Key": "order-42"})
    other = submit(stack, body, **{"Idempotency-Key": "order-43"})
    assert first["id"] == second["id"]
    assert other["id"] != first["id"]


def test_health_and_readiness(stack: Stack) -> None:
    assert HTTP.get(f"{stack.url}/healthz").json() == {"status": "ok"}
    ready = HTTP.get(f"{stack.url}/readyz")
    assert ready.status_code == 200 and ready.json()["workers"] == 1


# The Conclave with one active job, as `max_active_jobs = 1` runs it.
ONE_AT_A_TIME = {"worker": {"max_active_jobs": 1}}


@pytest.mark.parametrize("overrides", [{}, ONE_AT_A_TIME], ids=["plain", "one-at-a-time"])
def test_killed_worker_job_completes_on_another(
    stack_factory: Callable[..., Stack], overrides: dict[str, Any]
) -> None:
    stack = stack_factory(**overrides)
    job = submit(stack, {**COUNTING, "max_tokens": 150})
    first_tokens(stack, job["id"], 5)
    # Killed before the second worker starts: loading a model can take longer than the first
    # worker needs to finish the job.
    stack.kill("worker-1")
    stack.start_worker("worker-2")
    final = wait_status(stack, job["id"], {"finished", "failed"}, timeout_s=90)
    assert final["status"] == "finished", final
    assert final["attempts"] == 2
    assert final["usage"]["completion_tokens"] == 150
    # The re-run carries on from the streamed tokens; none is published twice.
    assert final["usage"]["resumed_tokens"] >= 5
    tokens = [data for event, _, data in events(stack, job["id"]) if event == "token"]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert "".join(t["text"] for t in tokens) == final["result"]["text"]
    assert len([t for t in tokens if t["token"] is not None]) == 150


def test_rq_info_shows_granarys_queues_and_workers(stack: Stack) -> None:
    rq = Path(sys.executable).with_name("rq")
    out = subprocess.run(
        [str(rq), "info", "--url", stack.settings.redis_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for queue in ("interactive", "batch", "warm"):
        assert queue in out
    assert "1 workers, 3 queues" in out
