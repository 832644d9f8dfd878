"""OpenAI-compatible endpoints, driven by the official `openai` client against real processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from tests.harness import HTTP, Stack

COUNTING = "Count: 1, 2, 3, 4, 5, 6, 7, 8,"
DOC = " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(30))


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack for the module: each test's requests and answers are its own."""
    return module_stack_factory(cache={"block_tokens": 64, "min_tokens": 16})


def client(stack: Stack, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_models_lists_the_served_model(stack: Stack) -> None:
    models = client(stack).models.list().data
    assert [m.id for m in models] == ["smollm2-135m"]


def test_completion_and_its_stream_agree(stack: Stack) -> None:
    api = client(stack)
    whole = api.completions.create(model="x", prompt=COUNTING, max_tokens=12, temperature=0)
    assert whole.object == "text_completion"
    assert whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    chunks = list(
        api.completions.create(
            model="x",
            prompt=COUNTING,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_completion_and_its_stream_agree(stack: Stack) -> None:
    api = client(stack)
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = api.chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=16,
        temperature=0,
        seed=3,  # type: ignore[arg-type]
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content
    stream = api.chat.completions.create(
        model="x",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        seed=3,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_sequences(stack: Stack) -> None:
    api = client(stack)
    full = api.completions.create(model="x", prompt=COUNTING, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text.strip().split(",")[2].strip()
    for stops in (stop, [stop, "never-appears"]):
        cut = api.completions.create(
            model="x", prompt=COUNTING, max_tokens=16, temperature=0, stop=stops
        )
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_repeated_document_reports_cached_tokens(stack: Stack) -> None:
    api = client(stack)
    prompt = DOC + "\nTotal boxes:"
    first = api.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0)
    second = api.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text


def test_unsupported_fields_are_refused_by_name(stack: Stack) -> None:
    api = client(stack)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        api.completions.create(model="x", prompt="hi", n=17)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        api.completions.create(model="x", prompt="hi", logit_bias={"1": 5})
    with pytest.raises(openai.BadRequestError, match="stop"):
        api.completions.create(model="x", prompt="hi", stop=[""])
    with pytest.raises(openai.BadRequestError, match="messages"):
        api.chat.completions.create(model="x", messages=[])
    with pytest.raises(openai.BadRequestError, match="context window"):
        api.completions.create(model="x", prompt="word " * 2000)
    # Labels that do not change the output are accepted and ignored.
    ok = api.completions.create(model="x", prompt="hi", max_tokens=2, user="u1", presence_penalty=0)
    assert ok.choices


def test_n_sampled_choices_share_one_prefill_and_repeat_by_seed(stack: Stack) -> None:
    api = client(stack)
    messages: Any = [{"role": "user", "content": DOC + "\nWhich city?"}]
    asked = {"model": "x", "messages": messages, "max_tokens": 10, "temperature": 1.0}
    before = job_ids(stack)
    whole = api.chat.completions.create(**asked, n=3, seed=5)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    # Choice i is what a request of its own with seed 5 + i gives.
    alone = [api.chat.completions.create(**asked, seed=5 + i) for i in range(3)]
    assert [c.message.content for c in whole.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert len({c.message.content for c in whole.choices}) > 1  # sampled: they differ
    assert whole.usage is not None and alone[0].usage is not None
    assert whole.usage.prompt_tokens == alone[0].usage.prompt_tokens  # counted once
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone if a.usage)
    # The three jobs read the prompt once: two of them took the first one's cells.
    views = [HTTP.get(f"{stack.url}/v1/jobs/{j}").json() for j in job_ids(stack) - before]
    first_three = sorted(views, key=lambda v: v["created_at"])[:3]
    reused = sorted(v["usage"]["cached_tokens"] for v in first_three)
    assert reused[1] >= whole.usage.prompt_tokens - 2, reused
    streamed = api.chat.completions.create(**asked, n=3, seed=5, stream=True)
    texts = ["", "", ""]
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [c.message.content for c in whole.choices] and finished == {0, 1, 2}


def test_n_greedy_choices_are_one_answer_given_n_times(stack: Stack) -> None:
    api = client(stack)
    one = api.completions.create(model="x", prompt=COUNTING, max_tokens=8, temperature=0)
    two = api.completions.create(model="x", prompt=COUNTING, max_tokens=8, temperature=0, n=2)
    assert [c.text for c in two.choices] == [one.choices[0].text] * 2
    assert two.usage is not None and one.usage is not None
    assert two.usage.completion_tokens == one.usage.completion_tokens  # decoded once
    chunks = list(
        api.completions.create(
            model="x", prompt=COUNTING, max_tokens=8, temperature=0, n=2, stream=True
        )
    )
    for index in (0, 1):
        text = "".join(
            c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index
        )
        assert text == one.choices[0].text


def test_a_client_that_gives_up_waiting_cancels_its_job(stack: Stack) -> None:
    body = {"model": "x", "prompt": COUNTING, "max_tokens": 600, "temperature": 0}
    before = job_ids(stack)
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(f"{stack.url}/v1/completions", json=body, timeout=2)
    (job_id,) = job_ids(stack) - before
    wait_until_cancelled(stack, job_id)


def job_ids(stack: Stack) -> set[str]:
    client = redis.Redis.from_url(stack.settings.redis_url)
    return {k.decode().split(":")[2] for k in client.keys("granary:job:*") if k.count(b":") == 2}


def wait_until_cancelled(stack: Stack, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while (job := HTTP.get(f"{stack.url}/v1/jobs/{job_id}").json())["status"] != "cancelled":
        assert job["status"] in ("queued", "started"), job
        assert time.monotonic() < deadline, "the job kept running after the client left"
        time.sleep(0.1)
    assert job["usage"]["completion_tokens"] < 600


def test_a_client_that_disconnects_cancels_its_job(stack: Stack) -> None:
    body = {"model": "x", "prompt": COUNTING, "max_tokens": 600, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{stack.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {") and '"text":"' in line)
        job_id = first.split('"id":"cmpl-')[1].split('"')[0]
    wait_until_cancelled(stack, job_id)


def test_message_shapes_of_current_clients(stack: Stack) -> None:
    """Text parts, `name` and the `developer` role render as the plain shapes they stand for."""
    api = client(stack)

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        reply = api.chat.completions.create(
            model="x",
            messages=messages,
            max_tokens=1,
            temperature=0,  # type: ignore[arg-type]
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A\nB"}]
    shaped = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        },
    ]
    assert prompt_tokens(shaped) == prompt_tokens(plain)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],  # type: ignore[list-item]
        )
    body = refused.value.body
    assert isinstance(body, dict)
    error = body.get("error", body)
    assert error["field"] == "messages.0.content.1"
    assert "image_url" in error["message"]
