"""Cold prefill beside llama.cpp's llama-server: the same prompt, the same threads, nothing cached.

A chat whose system message holds a nonce (so no two requests share more than the template's
first tokens, on any system) and whose user message is a ~1,200- or ~3,600-token document
(Qwen2.5-Coder-0.5B, 2 threads, greedy, 1 token, streaming `/v1/chat/completions`, timed at the
client: granary's time includes its whole job path). Systems run side by side, one request at a
time, in rounds: each round asks every system once per size, back to back, in an order that
rotates round by round, and a system's ratio to the peer is taken within each round
(bench/paired.py). Systems: granary as configured by default (the Conclave, `flash_attn` on), granary
with `flash_attn = false`, granary with its prefix cache off (no snapshot is captured or
written while the prompt is read), the same prompt prefilled in this process on a context laid
out as the Conclave's (256-token chunks, no prompt breaks, no job path, no cache: what the model
work alone costs; as the Conclave reads where a prompt row reads alike in any pass), the same
again with canonical chunk ends (also at the prompt's breaks, then its last token alone, as the
Conclave reads elsewhere: what those ends cost), and
`llama-server -np 8 -kvu` (`-fa auto`, its default, picks flash attention on a CPU). Target (issue 32): granary's cold TTFT at most llama-server's.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import httpx
import llama_cpp
from llama_cpp import Llama

from bench.conclave import Reply, document, llama_server, stream_chat
from bench.paired import (
    ForeignCpu,
    foreign_line,
    in_turn,
    no_peer_line,
    per_round,
    ratio_summary,
)
from shared.llm import render_prompt, tokenize
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.harness import Stack, free_port
from worker.decode_batch import fill_batch, llama_batch
from worker.kernels import prompt_chunk_kernels
from worker.model import load_model
from worker.prompt_breaks import prompt_breaks

SIZES = {"~1,200 tokens": 36, "~3,600 tokens": 108}
TARGET = 1.0
PEER = "llama-server -np 8 -kvu"
DEFAULT = "granary (default, flash_attn on)"
NO_CACHE = "granary, prefix cache off"
IN_PROCESS = "model work alone (in process, granary's context, 256-token chunks)"
CANONICAL = "model work alone, canonical chunk ends (breaks; the last token alone)"


Ask = Callable[[int, int], tuple[float, int]]  # (nonce, lines) -> TTFT s, prompt tokens


@contextmanager
def _granary(
    settings: Settings, log_dir: Path, db: int, flash_attn: bool = True, cache: bool = True
) -> Iterator[str]:
    run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="cold-"))
    run = settings.model_copy(
        update={
            "flash_attn": flash_attn,
            # Each stack its own queues: a worker takes only its own system's jobs.
            "redis_url": f"{settings.redis_url}?db={db}",
            "api": settings.api.model_copy(update={"port": free_port()}),
            "cache": settings.cache.model_copy(update={"dir": run_dir / "kv", "enabled": cache}),
        }
    )
    stack = Stack(run, run_dir)
    try:
        stack.start_api()
        stack.start_worker()
        yield stack.url
    finally:
        stack.stop()


def _messages(nonce: int, lines: int) -> tuple[str, str]:
    """The system message and the user message of one request."""
    return (
        f"Session {nonce}.",
        f"{document(nonce, lines)}\n\nWhich shelf holds the most crates of plums?",
    )


async def _ask(url: str, nonce: int, lines: int) -> Reply:
    system, text = _messages(nonce, lines)
    async with httpx.AsyncClient(timeout=600) as client:
        return await stream_chat(client, url, text, 1, system=system)


def _over_http(url: str) -> Ask:
    def ask(nonce: int, lines: int) -> tuple[float, int]:
        reply = asyncio.run(_ask(url, nonce, lines))
        return reply.ttft, reply.prompt_tokens

    return ask


@contextmanager
def _in_process(settings: Settings) -> Iterator[Callable[[bool], Ask]]:
    """The model work alone on the Conclave's context layout, then the first logits: one
    context, asked two ways (each ask clears its memory first). Chunks: the 256-token grid,
    the last one ending with the prompt, on the prompt-chunk kernels (Conclave._chunk_end
    where chunk ends are free); or with `canonical`, also ending at the prompt's breaks and
    before its last token, which is then decoded alone on the exact kernels."""
    n_seq = settings.worker.max_active_jobs + 4
    llama = load_model(settings, n_seq)
    memory = llama_cpp.llama_get_memory(llama.ctx)
    block = settings.cache.block_tokens

    def asker(canonical: bool) -> Ask:
        def ask(nonce: int, lines: int) -> tuple[float, int]:
            system, text = _messages(nonce, lines)
            request = JobRequest(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": text}]
            )
            tokens = tokenize(llama, render_prompt(llama, request))
            ends = _chunk_ends(llama, tokens, block, canonical)
            llama_cpp.llama_memory_clear(memory, True)
            started = time.perf_counter()
            with llama_batch(block) as batch:
                for start, end in itertools.pairwise([0, *ends]):
                    rows = [(tokens[p], p, 0) for p in range(start, end)]
                    fill_batch(batch, rows, logits=False)
                    batch.logits[len(rows) - 1] = end == len(tokens)  # the last only
                    alone = canonical and end == len(tokens)
                    kernels = nullcontext() if alone else prompt_chunk_kernels()
                    with kernels:
                        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
                            raise RuntimeError("llama_decode failed")
            return time.perf_counter() - started, len(tokens)

        return ask

    try:
        yield asker
    finally:
        llama.close()


def _chunk_ends(llama: Llama, tokens: list[int], block: int, canonical: bool) -> list[int]:
    """Where each pass of a cold prefill ends (see Conclave._chunk_end)."""
    if not canonical:
        return [*range(block, len(tokens), block), len(tokens)]
    last = len(tokens) - 1  # decoded alone, as the first decode step
    breaks = prompt_breaks(llama, tokens, None, limit=last)
    grid = range(block, last, block)
    return sorted({*grid, *breaks, last, len(tokens)})


def section(settings: Settings, log_dir: Path, server: Path | None, rounds: int) -> str:
    systems: dict[str, Ask] = {}
    with ExitStack() as running:
        for name, db, options in (
            (DEFAULT, 1, {}),
            ("granary, flash_attn off", 2, {"flash_attn": False}),
            (NO_CACHE, 3, {"cache": False}),
        ):
            url = running.enter_context(_granary(settings, log_dir, db, **options))
            systems[name] = _over_http(url)
        in_process = running.enter_context(_in_process(settings))
        systems[IN_PROCESS] = in_process(False)
        systems[CANONICAL] = in_process(True)
        if server is not None and server.exists():
            url = running.enter_context(llama_server(server, settings, log_dir))[0]
            systems[PEER] = _over_http(url)
        for ask in systems.values():  # load pages, nothing measured
            ask(1, 4)
        ttfts: dict[tuple[str, str], list[float]] = {}
        tokens: dict[tuple[str, str], int] = {}
        foreign: list[float] = []
        nonce = 1000
        for k in range(rounds):
            with ForeignCpu() as cpu:
                for size, lines in SIZES.items():
                    for name in in_turn(list(systems), k):
                        nonce += 1
                        ttft, tokens[(name, size)] = systems[name](nonce, lines)
                        ttfts.setdefault((name, size), []).append(ttft)
            foreign.append(cpu.share)
    return _render(systems, ttfts, tokens, foreign)


def _render(
    systems: dict[str, Ask],
    ttfts: dict[tuple[str, str], list[float]],
    tokens: dict[tuple[str, str], int],
    foreign: list[float],
) -> str:
    lines = [
        "## Cold prefill beside llama-server",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
        + f" {len(foreign)} rounds; TTFT is the median, a ratio's median and range are over"
        " the rounds' own ratios.",
        "",
        "| prompt | system | prompt tokens | cold TTFT s | vs model work alone | vs llama-server"
        f" | target ≤ {TARGET:.2f}× |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        peer = ttfts.get((PEER, size))
        alone = ttfts[(IN_PROCESS, size)]
        for name in systems:
            own = ttfts[(name, size)]
            median = statistics.median(own)
            over_alone = ratio_summary(per_round(own, alone)) if name != IN_PROCESS else "–"
            ratio, verdict = "–", "–"
            if peer is not None and name != PEER:
                rounds = per_round(own, peer)
                ratio = ratio_summary(rounds)
                if name.startswith("granary"):
                    verdict = "meets" if statistics.median(rounds) <= TARGET else "MISSES"
            lines.append(
                f"| {size} | {name} | {tokens[(name, size)]} | {median:.2f} | {over_alone}"
                f" | {ratio} | {verdict} |"
            )
    lines += ["", foreign_line(foreign)]
    lines += ["", _where_the_time_goes(ttfts)]
    if PEER not in systems:
        lines += ["", no_peer_line("column")]
    return "\n".join(lines) + "\n"


def _where_the_time_goes(ttfts: dict[tuple[str, str], list[float]]) -> str:
    """The default's time over the model work alone, in seconds (the job path, Redis, SSE,
    the model thread's turns), with and without snapshots written, and what canonical chunk
    ends (prompt breaks, the last token alone) cost over it. Each the median of the rounds' own
    differences: a difference of medians taken in different rounds mixes in how the host's
    speed moved between them."""

    def over(name: str, base: str, size: str) -> float:
        rounds = zip(ttfts[(name, size)], ttfts[(base, size)], strict=True)
        return statistics.median(a - b for a, b in rounds)

    parts = [
        f"{size}: {over(DEFAULT, IN_PROCESS, size):+.2f} s "
        f"({over(NO_CACHE, IN_PROCESS, size):+.2f} s with the prefix cache off); canonical "
        f"chunk ends {over(CANONICAL, IN_PROCESS, size):+.2f} s"
        for size in SIZES
    ]
    return (
        "Where granary's time goes, over the model work alone (medians of each round's own "
        "differences): "
        + "; ".join(parts)
        + ". The model work alone against llama-server: the same "
        "kernels, flash attention on both."
    )
