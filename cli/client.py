"""A small HTTP client for granary's API, used by `granary submit` (and handy in scripts)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from httpx_sse import connect_sse

from shared.errors import InvalidRequest
from shared.settings import Settings


class GranaryClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers)

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> GranaryClient:
        """The API these settings describe, with their first API key if keys are set."""
        base = url or f"http://{settings.api.host}:{settings.api.port}"
        return cls(base, settings.api_keys[0] if settings.api_keys else None)

    def extract(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/extractions", json=body)

    def batch(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/batches", json=body)

    def batch_status(self, batch_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/batches/{batch_id}")

    def batch_results(self, batch_id: str) -> Iterator[bytes]:
        with self._http.stream("GET", f"/v1/batches/{batch_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                _raise_for_error(response)
            for line in response.iter_lines():
                if line:
                    yield line.encode()

    def warm(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/warm", json=body)

    def warm_run(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/warm/runs/{run_id}")

    def _call(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        response = self._http.request(method, url, **kwargs)
        _raise_for_error(response)
        data: dict[str, Any] = response.json()
        return data

    def submit(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        response = self._http.post("/v1/jobs", json=body, headers=headers)
        _raise_for_error(response)
        job: dict[str, Any] = response.json()
        return job

    def events(self, job_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event, data) pairs until the final `done` or `error`."""
        url = f"/v1/jobs/{job_id}/events"
        with connect_sse(self._http, "GET", url, timeout=None) as source:
            for sse in source.iter_sse():
                if sse.event == "message" and not sse.data:
                    continue  # the keep-alive comment, seen as an event once an id was sent
                yield sse.event, orjson.loads(sse.data)
                if sse.event in ("done", "error"):
                    return

    def wait(self, job_id: str) -> dict[str, Any]:
        final: dict[str, Any] = {}
        for event, data in self.events(job_id):
            if event != "token":
                final = data
        return final


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise InvalidRequest(f"HTTP {response.status_code}: {message}")


def submit_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    prompt: str = args.prompt
    if prompt.startswith("@"):
        prompt = Path(prompt[1:]).read_text(encoding="utf-8")
    body: dict[str, Any] = {"prompt": prompt}
    for name in ("max_tokens", "temperature", "seed"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    client = GranaryClient.from_settings(settings, args.url)
    job = client.submit(body)
    if args.wait:
        sys.stdout.write(orjson.dumps(client.wait(job["id"]), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
        return 0
    final: dict[str, Any] = {}
    for event, data in client.events(job["id"]):
        if event == "token":
            sys.stdout.write(data["text"])
            sys.stdout.flush()
        else:
            final = data
    sys.stdout.write("\n")
    return 0 if final.get("status") == "finished" else 1
