"""New documents, many questions: the first read, beside llama-server.

Documents nobody has read yet, several questions each: ~570-token chat prompts (the document in
the system message, the question as the user message; Qwen2.5-Coder-0.5B-Instruct, 2 threads,
greedy, answers of at most 16 tokens), asked three ways: one `/v1/extractions` job per
document (granary only; all submitted at once), an OpenAI client asking one question at a time,
and an OpenAI client with 8 questions in flight (in document order, as a thread pool takes
them). granary (as configured by default; and for the extraction jobs, with a sequence for
every question of the three at once) and llama-server (`-np 8
-kvu`, built from the same llama.cpp) run side by side and take turns, round by round (each
client of each system once per round, in an order that rotates), each on
documents new to all. The ratio is taken per round:
the peer's seconds over granary's (above 1, granary is faster); the table gives the median and
the range over rounds, and the prompt tokens each system reused from memory.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.conclave import Reply, document, llama_server, stream_chat
from bench.paired import (
    ForeignCpu,
    foreign_line,
    in_turn,
    no_peer_line,
    per_round,
    ratio_summary,
)
from shared.settings import Settings
from tests.harness import Stack, free_port

DOCUMENTS = 3
QUESTIONS = (
    "Which shelf holds the most crates?",
    "Which clerk checked the first shelf?",
    "On which day was the last shelf checked?",
    "How many shelves hold pears?",
    "Which fruit is on the third shelf?",
    "How many crates are on the second shelf?",
    "Which clerk checked the most shelves?",
    "On which day were apples checked first?",
)
LINES = 17  # ~570-token prompts with the template and a question
MAX_TOKENS = 16
IN_FLIGHT = 8
PEER = "llama-server -np 8 -kvu"
GRANARY = "granary"
# More sequences than the default (max_active_jobs + 4 = 12): every question of the three
# extraction jobs, and each document, has one at once (docs/CONFIGURATION.md, memory).
WIDE_SEQUENCES = DOCUMENTS * (len(QUESTIONS) + 1) + 1
GRANARY_WIDE = f"granary, worker.sequences {WIDE_SEQUENCES}"
ONE_AT_A_TIME = "OpenAI client, one question at a time"
EIGHT_IN_FLIGHT = f"OpenAI client, {IN_FLIGHT} questions in flight"
EXTRACTIONS = "`POST /v1/extractions`, one job per document"
TARGETS = {ONE_AT_A_TIME: 1.1, EIGHT_IN_FLIGHT: 3.0}
TARGET_VS_BEST = {EXTRACTIONS: 1.5, EIGHT_IN_FLIGHT: 1.2}


@dataclass(frozen=True, slots=True)
class Timed:
    seconds: float
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _documents(seed: int) -> list[str]:
    return [document(seed + 7919 * d, LINES) for d in range(DOCUMENTS)]


def _asks(docs: list[str]) -> list[tuple[str, str]]:
    return [(doc, question) for doc in docs for question in QUESTIONS]


def _client() -> httpx.AsyncClient:
    # A new connection per request (see bench.conclave.new_client).
    return httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0))


def _summed(started: float, replies: list[Reply]) -> Timed:
    assert all(r.first is not None or r.tokens == 0 for r in replies)
    return Timed(
        time.perf_counter() - started,
        sum(r.prompt_tokens for r in replies),
        sum(r.cached_tokens for r in replies),
    )


async def _one_at_a_time(url: str, docs: list[str]) -> Timed:
    started = time.perf_counter()
    async with _client() as client:
        replies = [
            await stream_chat(client, url, q, MAX_TOKENS, system=doc) for doc, q in _asks(docs)
        ]
    return _summed(started, replies)


async def _in_flight(url: str, docs: list[str]) -> Timed:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def ask(client: httpx.AsyncClient, doc: str, question: str) -> Reply:
        async with slots:
            return await stream_chat(client, url, question, MAX_TOKENS, system=doc)

    started = time.perf_counter()
    async with _client() as client:
        replies = await asyncio.gather(*(ask(client, d, q) for d, q in _asks(docs)))
    return _summed(started, list(replies))


def _extractions(url: str, docs: list[str]) -> Timed:
    questions = [{"id": str(i), "question": q} for i, q in enumerate(QUESTIONS)]
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=900) as client:
        ids = [
            client.post(
                "/v1/extractions",
                json={"document": doc, "questions": questions, "max_tokens": MAX_TOKENS},
            ).json()["id"]
            for doc in docs
        ]
        for job_id in ids:
            while (view := client.get(f"/v1/jobs/{job_id}").json())["status"] in (
                "queued",
                "started",
            ):
                time.sleep(0.05)
            assert view["status"] == "finished", view
    return Timed(time.perf_counter() - started)


Clients = dict[str, Callable[[str, list[str]], Timed]]
CHAT_CLIENTS: Clients = {
    ONE_AT_A_TIME: lambda url, docs: asyncio.run(_one_at_a_time(url, docs)),
    EIGHT_IN_FLIGHT: lambda url, docs: asyncio.run(_in_flight(url, docs)),
}


def section(settings: Settings, log_dir: Path, server: Path | None, rounds: int) -> str:
    # Each system, each client: one Timed per round.
    timed: dict[tuple[str, str], list[Timed]] = {}
    foreign: list[float] = []
    with ExitStack() as running:
        default = _granary(running, settings, log_dir, settings.worker.sequences, db=1)
        wide = _granary(running, settings, log_dir, WIDE_SEQUENCES, db=2)
        systems: dict[str, tuple[str, Clients]] = {
            GRANARY: (default, {EXTRACTIONS: _extractions, **CHAT_CLIENTS}),
            GRANARY_WIDE: (wide, {EXTRACTIONS: _extractions}),
        }
        if server is not None and server.exists():
            url = running.enter_context(llama_server(server, settings, log_dir))[0]
            systems[PEER] = (url, CHAT_CLIENTS)
        for url, clients in systems.values():  # load pages, nothing measured
            next(iter(clients.values()))(url, [document(1, 2)])
        seed = 10_000
        asks = [(name, client) for name, (_, clients) in systems.items() for client in clients]
        for k in range(rounds):
            with ForeignCpu() as cpu:
                for name, client in in_turn(asks, k):
                    url, clients = systems[name]
                    seed += 100_000  # documents new to every system
                    timed.setdefault((name, client), []).append(
                        clients[client](url, _documents(seed))
                    )
            foreign.append(cpu.share)
    return _render(timed, foreign)


def _granary(
    running: ExitStack, settings: Settings, log_dir: Path, sequences: int | None, db: int
) -> str:
    """A stack of its own (its own port, and Redis database: its own queues); its URL."""
    # A cache of its own: states an earlier run saved would answer its documents at once.
    run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="first-read-"))
    cache = settings.cache.model_copy(update={"dir": run_dir / "kv"})
    worker = settings.worker.model_copy(update={"sequences": sequences})
    chosen = settings.model_copy(
        update={
            "cache": cache,
            "worker": worker,
            "redis_url": f"{settings.redis_url}?db={db}",
            "api": settings.api.model_copy(update={"port": free_port()}),
        }
    )
    stack = Stack(chosen, run_dir)
    running.callback(stack.stop)
    stack.start()
    return stack.url


def _render(timed: dict[tuple[str, str], list[Timed]], foreign: list[float]) -> str:
    lines = [
        "## New documents × questions: the first read beside llama-server",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
        + f" {DOCUMENTS} documents × {len(QUESTIONS)} questions, {len(foreign)} rounds.",
        "",
        "| client | system | seconds (median) | prompt tokens reused | vs the peer's same client "
        "| vs the peer's best client | targets (issue 32) |",
        "|---|---|---|---|---|---|---|",
    ]
    peer_rounds = [timed[(PEER, c)] for c in CHAT_CLIENTS if (PEER, c) in timed]
    peer_best = [min(t.seconds for t in per) for per in zip(*peer_rounds, strict=True)]
    for (name, client), runs in timed.items():
        seconds = [t.seconds for t in runs]
        reused = "–"
        if runs[0].prompt_tokens:
            reused = f"{runs[-1].cached_tokens:,} of {runs[-1].prompt_tokens:,} (last round)"
        same = best = "–"
        if name != PEER and (PEER, client) in timed:
            peer = [t.seconds for t in timed[(PEER, client)]]
            same = ratio_summary(per_round(peer, seconds))
        if name != PEER and peer_best:
            best = ratio_summary(per_round(peer_best, seconds))
        targets = _targets(client) if name == GRANARY else "–"
        lines.append(
            f"| {client} | {name} | {statistics.median(seconds):.1f} | {reused} | {same} | "
            f"{best} | {targets} |"
        )
    lines += ["", foreign_line(foreign)]
    if not peer_rounds:
        lines += ["", no_peer_line("rows")]
    return "\n".join(lines) + "\n"


def _targets(client: str) -> str:
    wanted = []
    if client in TARGETS:
        wanted.append(f"≥ {TARGETS[client]}× the same client")
    if client in TARGET_VS_BEST:
        wanted.append(f"≥ {TARGET_VS_BEST[client]}× the best")
    return ", ".join(wanted) or "–"
