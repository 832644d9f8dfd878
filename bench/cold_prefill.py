"""Cold prefill beside llama.cpp's llama-server: the same prompt, the same threads, nothing cached.

A chat whose system message holds a nonce (so no two requests share more than the template's
first tokens, on any system) and whose user message is a ~1,200- or ~3,600-token document
(Qwen2.5-0.5B, 2 threads, greedy, 1 token, streaming `/v1/chat/completions`, timed at the
client: granary's time includes its whole job path). Systems run side by side, one request at a
time, round-robin: granary as configured by default (the Conclave, `flash_attn` off), granary
with `flash_attn = true`, and `llama-server -np 8 -kvu`
(`-fa auto`, its default, picks flash attention on a CPU). Target (issue 17): granary's cold
TTFT at most 1.03 times llama-server's.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from bench.conclave import Reply, document, llama_server, stream_chat
from shared.settings import Settings
from tests.harness import Stack, free_port

SIZES = {"~1,200 tokens": 36, "~3,600 tokens": 108}
TARGET = 1.03
PEER = "llama-server -np 8 -kvu"


@contextmanager
def _granary(settings: Settings, log_dir: Path, flash_attn: bool, db: int) -> Iterator[str]:
    run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="cold-"))
    run = settings.model_copy(
        update={
            "flash_attn": flash_attn,
            # Each stack its own queues: a worker takes only its own system's jobs.
            "redis_url": f"{settings.redis_url}?db={db}",
            "api": settings.api.model_copy(update={"port": free_port()}),
            "cache": settings.cache.model_copy(update={"dir": run_dir / "kv"}),
        }
    )
    stack = Stack(run, run_dir)
    try:
        stack.start_api()
        stack.start_worker()
        yield stack.url
    finally:
        stack.stop()


async def _ask(url: str, nonce: int, lines: int) -> Reply:
    text = f"{document(nonce, lines)}\n\nWhich shelf holds the most crates of plums?"
    async with httpx.AsyncClient(timeout=600) as client:
        return await stream_chat(client, url, text, 1, system=f"Session {nonce}.")


def section(settings: Settings, log_dir: Path, server: Path | None, rounds: int) -> str:
    systems: dict[str, str] = {}
    with ExitStack() as running:
        systems["granary (default, flash_attn off)"] = running.enter_context(
            _granary(settings, log_dir, False, 1)
        )
        systems["granary, flash_attn on"] = running.enter_context(
            _granary(settings, log_dir, True, 2)
        )
        if server is not None and server.exists():
            systems[PEER] = running.enter_context(llama_server(server, settings, log_dir))[0]
        for url in systems.values():  # load pages, nothing measured
            asyncio.run(_ask(url, 1, 4))
        ttfts: dict[tuple[str, str], list[float]] = {}
        tokens: dict[tuple[str, str], int] = {}
        nonce = 1000
        for _ in range(rounds):
            for size, lines in SIZES.items():
                for name, url in systems.items():
                    nonce += 1
                    reply = asyncio.run(_ask(url, nonce, lines))
                    ttfts.setdefault((name, size), []).append(reply.ttft)
                    tokens[(name, size)] = reply.prompt_tokens
    return _render(systems, ttfts, tokens, rounds)


def _render(
    systems: dict[str, str],
    ttfts: dict[tuple[str, str], list[float]],
    tokens: dict[tuple[str, str], int],
    rounds: int,
) -> str:
    lines = [
        "## Cold prefill beside llama-server",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip() + f" Medians of {rounds} rounds.",
        "",
        "| prompt | system | prompt tokens | cold TTFT s | vs llama-server | target ≤ 1.03× |",
        "|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        peer = ttfts.get((PEER, size))
        for name in systems:
            median = statistics.median(ttfts[(name, size)])
            ratio, verdict = "–", "–"
            if peer is not None and name != PEER:
                value = median / statistics.median(peer)
                ratio = f"{value:.2f}×"
                verdict = "meets" if value <= TARGET else "MISSES"
            lines.append(
                f"| {size} | {name} | {tokens[(name, size)]} | {median:.2f} | {ratio} | {verdict} |"
            )
    if PEER not in systems:
        lines += ["", "llama-server was not built (`make peer-server`): no peer column."]
    return "\n".join(lines) + "\n"
