"""Model files served on the full job path, and streamed plain completions timed piece by piece
(the benches of model files: vocabulary trims, named models)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.conclave import document, new_client, sse_chunks
from shared.settings import Settings
from tests.harness import Stack, free_port


@dataclass(frozen=True, slots=True)
class Stream:
    started: float
    token_times: list[float]  # when each streamed piece arrived
    tokens: int
    prompt_tokens: int

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.started

    def decode_rate(self) -> float:
        return (self.tokens - 1) / (self.token_times[-1] - self.token_times[0])


async def complete(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> Stream:
    body = {
        "model": "bench",
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    async for chunk in sse_chunks(client, f"{url}/v1/completions", body):
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            times.append(time.perf_counter())
        usage = chunk.get("usage") or usage
    return Stream(started, times, usage["completion_tokens"], usage["prompt_tokens"])


async def clients(url: str, texts: list[list[str]], max_tokens: int) -> list[Stream]:
    async def one(client: httpx.AsyncClient, mine: list[str]) -> list[Stream]:
        return [await complete(client, url, t, max_tokens) for t in mine]

    async with new_client() as client:
        replies = await asyncio.gather(*(one(client, mine) for mine in texts))
    return [r for mine in replies for r in mine]


def together_rate(streams: Sequence[Stream]) -> float:
    """Pieces per second while every stream decodes: from the last first token to the first
    last one (each stream's prefill, and the tails, left out)."""
    start = max(s.token_times[0] for s in streams)
    end = min(s.token_times[-1] for s in streams)
    pieces = sum(1 for s in streams for t in s.token_times if start < t <= end)
    return pieces / (end - start)


def continued(seed: int) -> str:
    """~130 tokens (Qwen) of an inventory whose next lines every model writes on to the end
    of its budget (distinct numbers per seed)."""
    return document(seed, lines=4) + "\n"


@contextmanager
def served(settings: Settings, model: Path, log_dir: Path, db: int) -> Iterator[Stack]:
    """An API and one worker serving `model` with its own Redis database, port and cache."""
    run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="served-"))
    chosen = settings.model_copy(
        update={
            "model": str(model),
            "redis_url": f"{settings.redis_url}?db={db}",
            "api": settings.api.model_copy(update={"port": free_port()}),
            "cache": settings.cache.model_copy(update={"dir": run_dir / "kv"}),
        }
    )
    stack = Stack(chosen, run_dir)
    try:
        stack.start_api()
        stack.start_worker()
        yield stack
    finally:
        stack.stop()
