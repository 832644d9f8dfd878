"""API keys: every /v1 route needs one when configured, and a key sees only its own jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.harness import HTTP, Stack

DOC = " ".join(f"Invoice {i}: {i * 3 % 17} boxes of tea shipped to Lyon." for i in range(30))


@pytest.fixture(scope="module")
def stack(module_stack_factory: Callable[..., Stack]) -> Stack:
    """One stack, two keys and a cache namespace per key, for the module's tests that take
    `stack`: each sends its own prompts and reads only its own jobs, so they can share it."""
    return module_stack_factory(
        api_keys=["k1", "k2"], cache={"per_key": True, "block_tokens": 64, "min_tokens": 16}
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submit(stack: Stack, key: str, body: dict[str, Any]) -> dict[str, Any]:
    response = HTTP.post(f"{stack.url}/v1/jobs", json=body, headers=bearer(key))
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def wait(stack: Stack, key: str, job_id: str) -> dict[str, Any]:
    url = f"{stack.url}/v1/jobs/{job_id}/events"
    with httpx.stream("GET", url, headers=bearer(key), timeout=120) as r:
        for _ in r.iter_lines():
            pass
    job: dict[str, Any] = HTTP.get(f"{stack.url}/v1/jobs/{job_id}", headers=bearer(key)).json()
    return job


def test_without_keys_everything_is_open(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(workers=0)
    assert HTTP.get(f"{stack.url}/v1/models").status_code == 200


def test_every_v1_route_needs_a_valid_key(stack: Stack) -> None:
    routes = [
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/x"),
        ("DELETE", "/v1/jobs/x"),
        ("GET", "/v1/jobs/x/events"),
        ("GET", "/v1/cache"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/warm"),
        ("GET", "/v1/warm/runs"),
        ("GET", "/v1/warm/runs/x"),
    ]
    for method, path in routes:
        for headers in (
            {},
            bearer("wrong"),
            {"Authorization": "k1"},
            {"Authorization": "Basic k1"},
        ):
            response = httpx.request(method, f"{stack.url}{path}", headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["type"] == "invalid_api_key"
            assert response.headers["WWW-Authenticate"] == "Bearer"
    assert HTTP.get(f"{stack.url}/healthz").status_code == 200
    assert HTTP.get(f"{stack.url}/v1/models", headers=bearer("k2")).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_a_key_sees_and_cancels_only_its_own_jobs(stack: Stack) -> None:
    job = submit(stack, "k1", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    for method, path in [("GET", ""), ("GET", "/events"), ("DELETE", "")]:
        url = f"{stack.url}/v1/jobs/{job['id']}{path}"
        assert httpx.request(method, url, headers=bearer("k2")).status_code == 404, (method, path)
    assert wait(stack, "k1", job["id"])["status"] == "finished"
    # Idempotency keys are per API key too.
    body = {"prompt": "Hello", "max_tokens": 2}
    a = HTTP.post(
        f"{stack.url}/v1/jobs", json=body, headers=bearer("k1") | {"Idempotency-Key": "x"}
    )
    b = HTTP.post(
        f"{stack.url}/v1/jobs", json=body, headers=bearer("k2") | {"Idempotency-Key": "x"}
    )
    assert a.json()["id"] != b.json()["id"]


def test_per_key_cache_namespace(stack: Stack) -> None:
    body = {"prompt": DOC + "\nTotal boxes:", "max_tokens": 4, "temperature": 0}
    first = wait(stack, "k1", submit(stack, "k1", body)["id"])
    other = wait(stack, "k2", submit(stack, "k2", body)["id"])
    again = wait(stack, "k1", submit(stack, "k1", body)["id"])
    assert first["usage"]["cached_tokens"] == 0
    assert other["usage"]["cached_tokens"] == 0  # k2 cannot use what k1 computed
    assert again["usage"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    assert first["result"] == other["result"] == again["result"]


def test_a_key_warms_into_its_own_namespace_and_sees_only_its_runs(stack: Stack) -> None:
    body = {"document": DOC, "instructions": "Be brief."}
    run = HTTP.post(f"{stack.url}/v1/warm", json=body, headers=bearer("k1")).json()
    assert wait(stack, "k1", run["jobs"][0]["id"])["status"] == "finished"
    url = f"{stack.url}/v1/warm/runs"
    assert HTTP.get(f"{url}/{run['id']}", headers=bearer("k2")).status_code == 404
    assert HTTP.get(url, headers=bearer("k2")).json() == []
    assert [r["id"] for r in HTTP.get(url, headers=bearer("k1")).json()] == [run["id"]]
    question = {**body, "prompt": "How many invoices?", "max_tokens": 2, "temperature": 0}
    mine = wait(stack, "k1", submit(stack, "k1", question)["id"])
    theirs = wait(stack, "k2", submit(stack, "k2", question)["id"])
    assert mine["usage"]["cached_tokens"] > 0  # the whole document, warmed for k1
    assert theirs["usage"]["cached_tokens"] == 0


def test_the_key_is_checked_before_the_body_is_read(stack: Stack) -> None:
    url = f"{stack.url}/v1/jobs"
    headers = {"Content-Type": "application/json"}
    assert HTTP.post(url, content=b"{not json", headers=headers).status_code == 401
    huge = b"x" * (stack.settings.api.max_body_bytes + 1)
    assert HTTP.post(url, content=huge, headers=headers).status_code == 401
    assert (
        HTTP.post(url, content=b"{not json", headers={**headers, **bearer("k1")}).status_code == 400
    )


def test_docs_need_a_key_unless_opened(stack: Stack, stack_factory: Callable[..., Stack]) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert HTTP.get(f"{stack.url}{path}").status_code == 401, path
        assert HTTP.get(f"{stack.url}{path}", headers=bearer("k1")).status_code == 200, path
    opened = stack_factory(workers=0, api_keys=["k1"], api={"open_docs": True})
    assert HTTP.get(f"{opened.url}/openapi.json").status_code == 200
    assert HTTP.get(f"{opened.url}/v1/models").status_code == 401


def test_cache_report_shows_no_paths(stack: Stack) -> None:
    response = HTTP.get(f"{stack.url}/v1/cache", headers=bearer("k1"))
    report = response.json()
    assert "dir" not in report
    assert str(stack.settings.cache_dir) not in response.text
    assert report["enabled"] is True
