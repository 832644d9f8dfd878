"""Identical requests answered from the result store: real API, worker, Redis and SmolLM2."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis
from openai import OpenAI

from shared import keys
from shared.job_store import JobStore
from shared.result_cache import Entry, ResultCache
from shared.schemas import JobResult, JobStatus, ResultKey, TokenEvent, Usage, WorkOrder
from shared.settings import ResultCacheSettings
from tests.harness import HTTP, Stack
from tests.integration.test_job_path import COUNTING, events, first_tokens, submit, wait_status

DOC = " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(12))
ON = {"result_cache": {"enabled": True}}


@pytest.fixture(scope="module")
def shared_stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    return module_stack_factory(**ON)


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The module's stack with an empty result store and fresh counters: each test counts
    what it stores. (Each test follows its jobs to their end.)"""
    client = redis.Redis.from_url(shared_stack.settings.redis_url)
    for pattern in ("result:*", "metrics:*"):
        for key in client.scan_iter(f"{keys.PREFIX}:{pattern}"):
            client.delete(key)
    client.delete(keys.result_index())
    return shared_stack


def stored(stack: Stack) -> int:
    client = redis.Redis.from_url(stack.settings.redis_url)
    return int(client.zcard(keys.result_index()))


def wait_stored(stack: Stack, count: int) -> None:
    """The worker stores a result just after its job's `done` event: wait for it."""
    deadline = time.monotonic() + 10
    while stored(stack) < count:
        assert time.monotonic() < deadline, f"{stored(stack)} results stored, not {count}"
        time.sleep(0.02)


def run(stack: Stack, body: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The job's token events (data) and its final record."""
    stream = events(stack, submit(stack, body)["id"])
    assert stream[-1][0] == "done", stream[-1]
    return [data for event, _, data in stream if event != "done"], stream[-1][2]


def test_second_identical_greedy_request_is_answered_from_the_store(stack: Stack) -> None:
    body = {**COUNTING, "max_tokens": 12}
    first_tokens_, first = run(stack, body)
    assert first["usage"]["cached_result"] is False
    wait_stored(stack, 1)
    answered = submit(stack, body, **{"Idempotency-Key": "k-1"})
    # Finished before the POST returns: no worker was involved.
    assert answered["status"] == "finished" and answered["usage"]["cached_result"] is True
    stream = events(stack, answered["id"])
    again = stream[-1][2]
    assert [data for event, _, data in stream if event != "done"] == first_tokens_
    assert again["result"] == first["result"]
    assert {**again["usage"], "cached_result": False} == first["usage"]
    assert again["attempts"] == 1
    timings = again["timings"]
    assert timings["prefill_ms"] is None and timings["restore_ms"] is None
    assert 0 <= timings["ttft_ms"] < 1000
    # The same Idempotency-Key still names the same job, answered or not.
    assert submit(stack, body, **{"Idempotency-Key": "k-1"})["id"] == answered["id"]
    metrics = HTTP.get(f"{stack.url}/metrics").text
    assert "granary_result_cache_hits_total 1.0" in metrics
    assert "granary_result_cache_stored_total 1.0" in metrics


def test_requests_that_differ_are_not_answered_from_the_store(stack: Stack) -> None:
    body = {**COUNTING, "max_tokens": 8}
    run(stack, body)
    wait_stored(stack, 1)
    different = [
        {**body, "max_tokens": 9},
        {**body, "prompt": "Count: 2, 4, 6, 8,"},
        {**body, "stop": ["7"]},
        {**body, "temperature": 0.7},  # sampled, the seed drawn by the API
        {**body, "temperature": 0.7},  # ... so never the same request twice
        {**body, "cache": False},  # bypasses the lookup
    ]
    for request in different:
        _, final = run(stack, request)
        assert final["usage"]["cached_result"] is False, request
    assert run(stack, body)[1]["usage"]["cached_result"] is True


def test_cache_false_stores_nothing(stack: Stack) -> None:
    body = {"prompt": "Name a colour:", "max_tokens": 6, "temperature": 0}
    run(stack, {**body, "cache": False})
    _, final = run(stack, body)
    assert final["usage"]["cached_result"] is False  # the first run was not stored
    wait_stored(stack, 1)


def test_seeded_sampled_request_is_answered_only_with_its_seed(stack: Stack) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.9, "seed": 7}
    tokens, first = run(stack, body)
    wait_stored(stack, 1)
    again_tokens, again = run(stack, body)
    assert again["usage"]["cached_result"] is True
    assert again_tokens == tokens and again["result"] == first["result"]
    assert run(stack, {**body, "seed": 8})[1]["usage"]["cached_result"] is False


def test_cancelled_job_is_never_served(stack: Stack) -> None:
    body = {**COUNTING, "max_tokens": 300}
    job = submit(stack, body)
    first_tokens(stack, job["id"], 3)
    HTTP.delete(f"{stack.url}/v1/jobs/{job['id']}")
    assert wait_status(stack, job["id"], {"cancelled"})["status"] == "cancelled"
    retry = submit(stack, body)
    assert retry["status"] == "queued"
    first_tokens(stack, retry["id"], 1)  # it runs
    HTTP.delete(f"{stack.url}/v1/jobs/{retry['id']}")
    wait_status(stack, retry["id"], {"cancelled"})
    assert stored(stack) == 0


def test_openai_endpoints_answer_from_the_store_and_stream_alike(stack: Stack) -> None:
    api = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = api.chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=12,
        temperature=0,
    )
    wait_stored(stack, 1)
    chunks = list(
        api.chat.completions.create(
            model="x",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.model_extra == {"cached_result": True}
    assert whole.usage is not None and not whole.usage.model_extra
    bypass = api.chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"cache": False},
    )
    assert bypass.usage is not None and not bypass.usage.model_extra
    completion = api.completions.create(model="x", prompt="Count: 1, 2,", max_tokens=5, seed=3)
    wait_stored(stack, 2)
    repeat = api.completions.create(model="x", prompt="Count: 1, 2,", max_tokens=5, seed=3)
    assert repeat.choices[0].text == completion.choices[0].text
    assert repeat.usage is not None and repeat.usage.model_extra == {"cached_result": True}


def test_extraction_is_answered_from_the_store(stack: Stack) -> None:
    body = {
        "document": DOC,
        "questions": [
            {"id": "lyon", "question": "Where was the tea shipped?"},
            {"id": "boxes", "question": "How many boxes in invoice 3?"},
        ],
        "max_tokens": 8,
    }

    def extract() -> tuple[list[Any], dict[str, Any]]:
        job = HTTP.post(f"{stack.url}/v1/extractions", json=body).json()
        stream = events(stack, job["id"])
        return [d for e, _, d in stream if e != "done"], stream[-1][2]

    streamed, first = extract()
    wait_stored(stack, 1)
    again_streamed, again = extract()
    assert again["usage"]["cached_result"] is True
    assert again["extraction"]["object"] == first["extraction"]["object"]
    for qid, answer in again["extraction"]["answers"].items():
        assert answer["text"] == first["extraction"]["answers"][qid]["text"]
        assert answer["usage"]["cached_result"] is True
    tokens = [d for d in streamed if "answer" not in d]
    assert [d for d in again_streamed if "answer" not in d] == tokens
    answers = [d["answer"]["text"] for d in again_streamed if "answer" in d]
    assert answers == [d["answer"]["text"] for d in streamed if "answer" in d]


def test_per_key_namespaces_never_share_results(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(api_keys=["key-a", "key-b"], cache={"per_key": True}, **ON)

    def run_as(key: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}"}
        body = {**COUNTING, "max_tokens": 6}
        job = HTTP.post(f"{stack.url}/v1/jobs", json=body, headers=headers).json()
        url = f"{stack.url}/v1/jobs/{job['id']}"
        with httpx.stream("GET", f"{url}/events", headers=headers, timeout=60) as r:
            for _ in r.iter_lines():
                pass
        final: dict[str, Any] = HTTP.get(url, headers=headers).json()
        return final

    first = run_as("key-a")
    wait_stored(stack, 1)
    assert run_as("key-b")["usage"]["cached_result"] is False
    again = run_as("key-a")
    assert again["usage"]["cached_result"] is True
    assert again["result"] == first["result"]


def test_sampled_rows_decoded_beside_others_are_stored_as_a_lone_run_draws_them(
    stack: Stack,
) -> None:
    """With the kernels `make install` builds a row decoded in a batch gets a lone run's logits
    (the worker's row check), so a seeded draw there is reproducible: stored, and what the same
    request alone draws. (With other kernels it is not stored: Ended.drifted.)"""
    bodies = [
        {"prompt": f"{p} Count: 1, 2, 3,", "max_tokens": 60, "temperature": 0.8, "seed": 5}
        for p in "AB"
    ]
    jobs = [submit(stack, body) for body in bodies]
    together = [wait_status(stack, job["id"], {"finished"}) for job in jobs]
    wait_stored(stack, 2)
    assert "batched rows equal lone rows" in stack.log("worker-1")
    for body, beside in zip(bodies, together, strict=True):
        alone = wait_status(stack, submit(stack, {**body, "cache": False})["id"], {"finished"})
        assert alone["result"]["text"] == beside["result"]["text"]


# No model: the store's own rules against a real Redis.


def test_a_failed_or_cancelled_job_has_no_stream_to_store(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    store = JobStore(client, 60)
    order = WorkOrder.model_validate(
        {
            "prompt": {"text": "x", "add_bos": True},
            "prompt_tokens": 1,
            "max_tokens": 2,
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": 0,
            "stop": [],
        }
    )
    for status in ("failed", "cancelled", "finished"):
        store.create(status, "interactive", order)
        store.start(status)
        store.emit(status, [TokenEvent(index=0, text="a", token=1)])
        if status == "cancelled":  # a client's cancel wins over the worker's finish
            store.cancel(status)
            store.finish(
                status, JobStatus.FINISHED, result=JobResult(text="a", finish_reason="length")
            )
        else:
            store.finish(status, JobStatus(status))
    assert store.finished_events("failed") is None
    assert store.finished_events("cancelled") is None
    assert [e.event for e in store.finished_events("finished") or []] == ["token", "done"]


def test_store_is_bounded_and_keyed_to_its_identity(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    settings = ResultCacheSettings(max_entries=2)
    cache = ResultCache(client, settings, identity="me")
    entry = Entry(
        events=[("token", "{}")], result=JobResult(text="", finish_reason="stop"), usage=Usage()
    )
    key = [ResultKey(digest=f"d{i}", identity="me") for i in range(3)]
    assert not cache.record(ResultKey(digest="x", identity="another"), entry)
    cache.record(key[0], entry)
    cache.record(key[1], entry)
    assert cache.lookup(key[0]) == entry  # used: key[1] is now the least recently used
    cache.record(key[2], entry)
    assert cache.lookup(key[1]) is None
    assert cache.lookup(key[0]) == entry and cache.lookup(key[2]) == entry
    assert client.ttl(keys.result_entry("d0")) <= settings.ttl_s
    too_big = ResultCacheSettings(max_entry_bytes=1024)
    big = entry.model_copy(update={"events": [("token", "x" * 2000)]})
    assert not ResultCache(client, too_big, identity="me").record(key[0], big)
    assert orjson.loads(client.hget(keys.metrics_counters(), "result_cache_stored") or b"0") == 3
