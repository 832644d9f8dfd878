"""A document inside a chat message, no `document` field: the next question's first token.

What OpenAI clients send: one user message holding a ~3,000-token document, a blank line and
a question (Qwen2.5-Coder-0.5B, 2 threads, greedy, streaming `/v1/chat/completions`, timed at the
client). A first question prefills cold; five more follow in the same server process (memory);
then the server restarts before each of five more (granary: only the cache directory can
help). llama.cpp's `llama-server -np 8 -kvu` answers the same questions about another document
of the same length in the same run (its default: no slot files, so a restart starts cold).
granary's prompt breaks (worker/prompt_breaks.py) end a chunk where the question starts, so the
document is saved and restored whole. Medians; the slowest too. Targets (issue 17): ≤ 0.35 s in
the same process and after a restart.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import count
from pathlib import Path

import httpx

from bench.conclave import Reply, document, llama_server, stream_chat
from bench.paired import no_peer_line
from shared.settings import Settings
from tests.harness import Stack

QUESTIONS = (
    "Which shelf holds the most crates of plums?",
    "Which clerk checked shelf 7?",
    "On which day was shelf 12 checked?",
    "How many crates of pears are on shelf 30?",
    "Which shelves did clerk 12 check?",
    "On which shelf are the apples checked on day 5?",
    "How many shelves hold plums?",
    "Which clerk checked the shelf with the fewest crates?",
    "On which day were the most shelves checked?",
    "How many crates of apples are on shelf 44?",
    "Which shelf did clerk 20 check last?",
)
REPEATS = 5
TARGET_S = 0.35
PEER = "llama-server -np 8 -kvu"


@dataclass(frozen=True, slots=True)
class Run:
    label: str
    replies: list[Reply]


# A server: enter to start one, which gives its URL.
Server = Callable[[], AbstractContextManager[str]]


async def _ask(url: str, text: str) -> Reply:
    async with httpx.AsyncClient(timeout=600) as client:
        reply = await stream_chat(client, url, text, max_tokens=4)
    assert reply.first is not None and reply.prompt_tokens, "no token or no usage"
    return reply


def _questions(server: Server, page: str) -> list[Run]:
    """Cold, REPEATS in the same process, then REPEATS each after a restart."""
    asked = iter(QUESTIONS)
    with server() as url:
        cold = [asyncio.run(_ask(url, f"{page}\n\n{next(asked)}"))]
        memory = [asyncio.run(_ask(url, f"{page}\n\n{next(asked)}")) for _ in range(REPEATS)]
    restarted = []
    for _ in range(REPEATS):
        with server() as url:
            restarted.append(asyncio.run(_ask(url, f"{page}\n\n{next(asked)}")))
    return [
        Run("cold (first question)", cold),
        Run("same process", memory),
        Run("after a restart", restarted),
    ]


def section(settings: Settings, log_dir: Path, server: Path | None, seed: int) -> str:
    stack = Stack(settings, log_dir)
    systems: dict[str, list[Run]] = {}
    try:
        stack.start_api()
        systems["granary"] = _questions(partial(_worker, stack, count(1)), document(seed))
    finally:
        stack.stop()
    if server is not None and server.exists():
        peer = partial(_peer, server, settings, log_dir)
        systems[PEER] = _questions(peer, document(seed + 1))
    return _render(systems)


@contextmanager
def _worker(stack: Stack, numbers: Iterator[int]) -> Iterator[str]:
    """The API stays up; the worker restarts (stopping it writes pending snapshots)."""
    name = f"worker-{next(numbers)}"
    stack.start_worker(name)
    try:
        yield stack.url
    finally:
        stack.stop_process(name)


@contextmanager
def _peer(server: Path, settings: Settings, log_dir: Path) -> Iterator[str]:
    with llama_server(server, settings, log_dir) as (url, _pid):
        yield url


def _render(systems: dict[str, list[Run]]) -> str:
    lines = [
        "## A document inside a chat message: the next question",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "",
        "| system | run | questions | prompt tokens | cached tokens | TTFT s (median) | slowest s "
        "| vs cold | target ≤ 0.35 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in systems.items():
        cold_s = statistics.median(r.ttft for r in runs[0].replies)
        for run in runs:
            ttfts = [r.ttft for r in run.replies]
            median = statistics.median(ttfts)
            verdict = "—"
            if name == "granary" and not run.label.startswith("cold"):
                verdict = "meets" if median <= TARGET_S else "MISSES"
            lines.append(
                f"| {name} | {run.label} | {len(ttfts)} | {run.replies[0].prompt_tokens} | "
                f"{statistics.median(r.cached_tokens for r in run.replies):.0f} | {median:.2f} | "
                f"{max(ttfts):.2f} | {cold_s / median:.0f}× | {verdict} |"
            )
    if PEER not in systems:
        lines += ["", no_peer_line("rows")]
    return "\n".join(lines) + "\n"
