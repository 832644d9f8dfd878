"""An edited document: the same question about a new version of a document read before.

A ~3,000-token document (Qwen2.5-Coder-0.5B, 2 threads, greedy, 8 tokens, streaming
`/v1/chat/completions`, the document as the system message, the question as the user
message) is asked about once, then again with one line two thirds of the way in changed, as
a revised contract or report comes back. What the second read costs is what each system
reuses of the first: llama-server (`-np 8 -kvu`) its slot's cells up to the first changed
token; granary its memory up to a point inside the changed line's 256-token chunk where the
start-up's slice check allows it (a multiple of the kernels' granule, 32 tokens before the
chunk's end), else up to the chunk's start (docs/ARCHITECTURE.md, "Warm equals cold"). The
systems run side by side and take turns within each round, the order rotating, each on a
document new to it; the edited read's time to first token is compared per round (bench/paired.py).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
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
from shared.llm import load_llama, quiet_native_logs, render_prompt, tokenize
from shared.prefix_cache import common_prefix_len
from shared.schemas import JobRequest
from shared.settings import Settings
from tests.harness import Stack

LINES = 90  # ~3,000 tokens
EDITED_LINE = 60
QUESTION = "Which shelf holds the most crates of plums?"
MAX_TOKENS = 8
GRANARY, PEER = "granary", "llama-server -np 8 -kvu"


@dataclass(frozen=True, slots=True)
class Asked:
    first: Reply  # the document as first sent
    edited: Reply  # the same question after the edit


def edited(text: str) -> str:
    """`text` with one line's count of crates changed."""
    lines = text.split("\n")
    head, _, rest = lines[EDITED_LINE].partition(": ")
    count, _, tail = rest.partition(" ")
    lines[EDITED_LINE] = f"{head}: {int(count) % 89 + 10} {tail}"
    return "\n".join(lines)


async def _ask(url: str, text: str) -> Reply:
    async with httpx.AsyncClient(timeout=900) as client:
        return await stream_chat(client, url, QUESTION, MAX_TOKENS, system=text)


async def _ask_both(url: str, text: str) -> Asked:
    return Asked(await _ask(url, text), await _ask(url, edited(text)))


def _first_change(settings: Settings, text: str) -> int:
    """Where the two versions' rendered prompts part, in tokens."""
    with quiet_native_logs():
        llama = load_llama(settings, vocab_only=True)
    prompts = [
        tokenize(
            llama, render_prompt(llama, JobRequest.model_validate({"messages": _messages(version)}))
        )
        for version in (text, edited(text))
    ]
    llama.close()
    return common_prefix_len(*prompts)


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": text}, {"role": "user", "content": QUESTION}]


def section(settings: Settings, log_dir: Path, server: Path | None, rounds: int) -> str:
    asked: dict[str, list[Asked]] = {}
    foreign = []
    with ExitStack() as running:
        run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="edited-document-"))
        cache = settings.cache.model_copy(update={"dir": run_dir / "kv"})
        stack = Stack(settings.model_copy(update={"cache": cache}), run_dir)
        running.callback(stack.stop)
        stack.start()
        urls = {GRANARY: stack.url}
        if server is not None and server.exists():
            urls[PEER] = running.enter_context(llama_server(server, settings, log_dir))[0]
        for url in urls.values():  # load pages, nothing measured
            asyncio.run(_ask(url, document(1, 4)))
        seed = 20_000
        for k in range(rounds):
            with ForeignCpu() as cpu:
                for name in in_turn(list(urls), k):
                    seed += 10_000  # a document new to every system
                    asked.setdefault(name, []).append(
                        asyncio.run(_ask_both(urls[name], document(seed, LINES)))
                    )
            foreign.append(cpu.share)
    return _render(asked, foreign, _first_change(settings, document(seed, LINES)))


def _render(asked: dict[str, list[Asked]], foreign: list[float], change: int) -> str:
    lines = [
        "## An edited document: the same question again",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
        + f" {len(foreign)} rounds; medians, a ratio's median and range over the rounds.",
        "",
        "| system | prompt tokens | first changed token | tokens reused (edited read) "
        "| TTFT s, first read | TTFT s, edited read | edited read, the peer's TTFT over granary's |",
        "|---|---|---|---|---|---|---|",
    ]
    peer = [a.edited.ttft for a in asked.get(PEER, [])]
    for name, runs in asked.items():
        vs = (
            ratio_summary(per_round(peer, [a.edited.ttft for a in runs]))
            if peer and name != PEER
            else "–"
        )
        reused = statistics.median(a.edited.cached_tokens for a in runs)
        lines.append(
            f"| {name} | {runs[-1].edited.prompt_tokens:,} | {change:,} | {reused:,.0f} "
            f"| {statistics.median(a.first.ttft for a in runs):.2f} "
            f"| {statistics.median(a.edited.ttft for a in runs):.2f} | {vs} |"
        )
    lines += ["", foreign_line(foreign)]
    if not peer:
        lines += ["", no_peer_line("rows")]
    return "\n".join(lines) + "\n"
