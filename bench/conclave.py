"""Many users at once on one worker (the Conclave), side by side with llama.cpp's llama-server.

A: N clients start at the same moment, each streaming two OpenAI chat completions one after
the other (distinct ~115-token prompts, 64 tokens, greedy): total completion tokens per second
of wall time, and the p50 of the requests' times to first token. B: one client asks about a ~3,000-token document; one
second later four short chats arrive: their p95 TTFT, and the long request's TTFT against its
TTFT alone (another document of the same length, so no cache helps either), measured first,
on a worker that has served only a warm-up request.

Every system runs alone on the machine, with the same model file and 2 threads: granary
(API + one worker: one job at a time as before the Conclave, then 8 at once: with the kernels
`make install` builds, whose batched rows equal lone ones, so exact batching replays nothing;
then with the stock kernels (`make wheel-stock`), where exact batching replays near ties, and
with `worker.exact_batching` off, which does not; last with `flash_attn` off, the default
before 2026-12-04; llama-server chooses flash attention by itself) and
`llama-server -np 8 -kvu` built from the llama.cpp llama-cpp-python vendors (`make peer-server`).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from shared.models import resolve_model
from shared.settings import Settings
from tests.harness import Stack, _get_ok, _wait_for, free_port

CLIENTS = (1, 4, 8)
# How many jobs a worker should decode at once (`worker.max_active_jobs`): more clients than
# the largest setting, so every setting runs full.
SWEEP_ACTIVE = (4, 8, 16)
SWEEP_CLIENTS = 16
MAX_TOKENS = 64
REQUESTS = 2  # per client in A, one after another
SHORT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Reply:
    started: float
    first: float | None
    ended: float
    tokens: int
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return (self.first or self.ended) - self.started


def prompt(i: int) -> str:
    """A distinct ~115-token request (no two share more than the template's first tokens)."""
    return (
        f"Customer {i * 7919 % 10007} wrote about order {i * 104729 % 99991}: the parcel "
        f"arrived on day {i % 28 + 1} with {i % 5 + 2} items missing, the box was damaged on "
        f"side {'ABCD'[i % 4]}, and the invoice listed a price of {i * 13 % 97 + 10}.50 euros "
        f"instead of {i * 17 % 89 + 5}.25 euros. They ask for a refund of the difference and "
        f"a replacement of the missing items within {i % 9 + 3} days. Write a polite reply that "
        "confirms each point, says what happens next, and asks one clarifying question."
    )


def document(seed: int, lines: int = 90) -> str:
    """A ~3,000-token (Qwen) inventory document. Another seed gives other numbers of the same
    widths, so every system and run reads as many tokens (the seeds of the runs differ by
    10,000s: unpadded, the peer's document was a quarter longer than the first run's)."""
    tag = f"{seed % 100_000:05d}"
    return "\n".join(
        f"Shelf {tag}-{n:03d}: {(n * 37 + seed) % 90 + 10} crates of "
        f"{('pears', 'apples', 'plums')[n % 3]}, checked on day {(n * 11 + seed) % 28 + 1:02d} "
        f"by clerk {(n * 7 + seed) % 13 + 10}."
        for n in range(lines)
    )


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    text: str,
    max_tokens: int,
    delay_s: float = 0.0,
    system: str | None = None,
) -> Reply:
    await asyncio.sleep(delay_s)
    messages = [{"role": "user", "content": text}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Reply(
        started,
        first,
        time.perf_counter(),
        usage.get("completion_tokens", 0),
        usage.get("prompt_tokens", 0),
        cached,
    )


def _client() -> httpx.AsyncClient:
    """A new connection per request: a pooled one left idle past the server's keep-alive
    timeout (llama-server's is 5 s) can be closed just as a request goes out on it, and the
    request then fails with "Server disconnected" (it did, twice, mid-run)."""
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


async def _at_once(url: str, texts: list[str], max_tokens: int) -> list[Reply]:
    async with _client() as client:
        return list(await asyncio.gather(*(stream_chat(client, url, t, max_tokens) for t in texts)))


async def _clients(url: str, texts: list[list[str]], max_tokens: int) -> list[Reply]:
    """Each client sends its requests one after another, all clients at once."""

    async def one(client: httpx.AsyncClient, mine: list[str]) -> list[Reply]:
        return [await stream_chat(client, url, t, max_tokens) for t in mine]

    async with _client() as client:
        replies = await asyncio.gather(*(one(client, mine) for mine in texts))
    return [r for mine in replies for r in mine]


async def _long_and_short(url: str, doc: str, shorts: list[str]) -> tuple[Reply, list[Reply]]:
    question = f"{doc}\n\nWhich shelf holds the most crates of plums? Answer briefly."
    async with _client() as client:
        long = stream_chat(client, url, question, SHORT_TOKENS)
        others = [stream_chat(client, url, t, SHORT_TOKENS, delay_s=1.0) for t in shorts]
        replies = await asyncio.gather(long, *others)
    return replies[0], list(replies[1:])


@dataclass(frozen=True, slots=True)
class LoadRow:
    system: str
    clients: int
    tok_s: float
    ttft_p50: float


@dataclass(frozen=True, slots=True)
class MixRow:
    system: str
    short_p95: float
    long_ttft: float
    long_alone: float
    peak_rss_mb: int  # the model process's, over both scenarios


def peak_rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return 0


def load_round(url: str, system: str, n: int, offset: int) -> LoadRow:
    """n clients at once, each sending REQUESTS requests one after the other."""
    texts = [
        [prompt(offset + n * 100 + i * REQUESTS + k) for k in range(REQUESTS)] for i in range(n)
    ]
    replies = asyncio.run(_clients(url, texts, MAX_TOKENS))
    wall = max(r.ended for r in replies) - min(r.started for r in replies)
    tokens = sum(r.tokens for r in replies)
    return LoadRow(system, n, tokens / wall, statistics.median(r.ttft for r in replies))


def measure(url: str, system: str, offset: int, pid: int) -> tuple[list[LoadRow], MixRow]:
    """Both scenarios against a running server; `offset` keeps prompts unseen by earlier runs."""
    asyncio.run(_at_once(url, [prompt(offset + 999)], 4))  # warm-up: load pages, JIT nothing
    # Alone first, on a worker that has served nothing else, as the one-job engine does.
    alone, _ = asyncio.run(_long_and_short(url, document(offset + 1), []))
    rows = [load_round(url, system, n, offset) for n in CLIENTS]
    shorts = [prompt(offset + 500 + i) for i in range(4)]
    long, others = asyncio.run(_long_and_short(url, document(offset + 2), shorts))
    p95 = sorted(r.ttft for r in others)[-1]  # the worst of four
    return rows, MixRow(system, p95, long.ttft, alone.ttft, peak_rss_mb(pid))


@contextmanager
def granary(
    settings: Settings, log_dir: Path, run: Run, stock_site: Path | None
) -> Iterator[tuple[str, int]]:
    knobs = {"exact_batching": run.exact, "max_active_jobs": run.active}
    # A cache of its own: a state another run (or bench) saved would answer a prompt at once.
    cache = {"dir": Path(tempfile.mkdtemp(dir=log_dir, prefix="kv-"))}
    chosen = settings.model_copy(
        update={
            "worker": settings.worker.model_copy(update=knobs),
            "cache": settings.cache.model_copy(update=cache),
            "flash_attn": run.flash_attn,
        }
    )
    env = {"PYTHONPATH": str(stock_site)} if run.stock and stock_site is not None else {}
    stack = Stack(chosen, log_dir, env=env)
    try:
        stack.start_api()
        worker = stack.start_worker()
        yield stack.url, worker.pid
        # Which way the worker's batched rows were found (worker/conclave/row_check.py).
        if run.active > 1 and f"batched rows {run.rows}" not in stack.log("worker"):
            raise RuntimeError(f"{run.name}: the worker's rows were not found to {run.rows}")
    finally:
        stack.stop()


@contextmanager
def llama_server(server: Path, settings: Settings, log_dir: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    model = resolve_model(settings.model, settings.data_dir)
    command = [
        str(server),
        *("-m", str(model), "--port", str(port), "--host", "127.0.0.1"),
        *("-t", str(settings.threads), "-tb", str(settings.threads)),
        *("-c", str(8 * settings.n_ctx), "-np", "8", "-kvu"),
    ]
    log = (log_dir / "llama-server.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _get_ok(f"http://127.0.0.1:{port}/health"), "llama-server", 180)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(30)
        log.close()


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    exact: bool
    active: int
    stock: bool = False  # the stock kernels (make wheel-stock) instead of the installed ones
    flash_attn: bool = True

    @property
    def rows(self) -> str:
        """What the worker's row check must have logged (stock kernels take other code paths
        by row count, flash attention's included: worker/conclave/row_check.py)."""
        return "differ from" if self.stock else "equal"


RUNS = (
    Run("granary, one job at a time (max_active_jobs 1)", True, 1),
    Run("granary, exact (default)", True, 8),
    Run("granary, exact, stock kernels (near-tie replays)", True, 8, stock=True),
    Run("granary, exact_batching off, stock kernels", False, 8, stock=True),
    # What flash attention (llama-server's `-fa auto` and granary's default) changes.
    Run("granary, exact, flash_attn off", True, 8, flash_attn=False),
)


def section(settings: Settings, log_dir: Path, server: Path | None, stock_site: Path | None) -> str:
    loads: list[LoadRow] = []
    mixes: list[MixRow] = []
    runs = [r for r in RUNS if stock_site is not None or not r.stock]
    for offset, run in enumerate(runs):
        with granary(settings, log_dir, run, stock_site) as (url, pid):
            rows, mix = measure(url, run.name, offset * 10_000, pid)
        loads += rows
        mixes.append(mix)
    peer = server is not None and server.exists()
    peer_failure = None
    if server is not None and peer:
        try:
            with llama_server(server, settings, log_dir) as (url, pid):
                rows, mix = measure(url, "llama-server -np 8 -kvu", 90_000, pid)
            loads += rows
            mixes.append(mix)
        except httpx.HTTPError as exc:  # the peer failing must not cost granary's rows
            peer_failure = f"{type(exc).__name__}: {exc}; its log ends:\n" + _log_tail(log_dir)
    text = _render(loads, mixes, peer=peer, peer_failure=peer_failure)
    if stock_site is None:
        text += "\nThe stock kernels were not given (`make wheel-stock`): no rows for them.\n"
    return text


def _log_tail(log_dir: Path, lines: int = 12) -> str:
    log = log_dir / "llama-server.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _render(loads: list[LoadRow], mixes: list[MixRow], peer: bool, peer_failure: str | None) -> str:
    peer_rows = {r.clients: r for r in loads if r.system.startswith("llama-server")}
    lines = [
        "## Many users on one worker (the Conclave)",
        "",
        "`bench/conclave.py`: Qwen2.5-0.5B, 2 threads, one worker; streaming OpenAI chat, distinct "
        f"~115-token prompts, {MAX_TOKENS} tokens each, greedy; all clients start at once and "
        f"each sends {REQUESTS} requests one after the other. tok/s: completion tokens over the "
        "wall time of the round; TTFT over all its requests.",
        "",
        "| system | clients | tok/s | TTFT p50 s | tok/s vs peer | TTFT vs peer |",
        "|---|---|---|---|---|---|",
    ]
    for r in loads:
        peer_row = peer_rows.get(r.clients)
        ratio = f"{r.tok_s / peer_row.tok_s:.2f}×" if peer_row else "–"
        ttft = f"{r.ttft_p50 / peer_row.ttft_p50:.2f}×" if peer_row else "–"
        lines.append(
            f"| {r.system} | {r.clients} | {r.tok_s:.1f} | {r.ttft_p50:.2f} | {ratio} | {ttft} |"
        )
    if not peer:
        lines += ["", "llama-server was not built (`make peer-server`): no peer column."]
    if peer_failure is not None:
        lines += ["", "llama-server FAILED during this run:", "", "```", peer_failure, "```"]
    lines += [
        "",
        "A ~3,000-token document question, and four short chats arriving 1 s later "
        f"({SHORT_TOKENS} tokens each). Targets: short chats' p95 TTFT ≤ 3 s, the long one's "
        "TTFT ≤ 1.25× alone. Alone: another document of the same length, asked first, before "
        "the many-client rounds; the mixed run comes after them.",
        "",
        "| system | short chats p95 TTFT s | long TTFT s | long alone s | long / alone | "
        "peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for m in mixes:
        lines.append(
            f"| {m.system} | {m.short_p95:.2f} | {m.long_ttft:.2f} | {m.long_alone:.2f} | "
            f"{m.long_ttft / m.long_alone:.2f}× | {m.peak_rss_mb} |"
        )
    return "\n".join(lines) + "\n"


def sweep_section(settings: Settings, log_dir: Path) -> str:
    """One round of SWEEP_CLIENTS clients per `max_active_jobs` setting (exact, as by default)."""
    rows = []
    for i, active in enumerate(SWEEP_ACTIVE):
        run = Run(f"max_active_jobs {active}", True, active)
        offset = 100_000 + i * 1000
        with granary(settings, log_dir, run, None) as (url, _pid):
            asyncio.run(_at_once(url, [prompt(offset + 999)], 4))  # warm-up
            rows.append((active, load_round(url, run.name, SWEEP_CLIENTS, offset)))
    lines = [
        "## How many jobs a worker decodes at once",
        "",
        f"`bench/conclave.py`, `worker.max_active_jobs` (default 8): {SWEEP_CLIENTS} clients at "
        f"once, each sending {REQUESTS} requests one after the other (distinct ~115-token chats, "
        f"{MAX_TOKENS} tokens, greedy, exact batching; Qwen2.5-0.5B, 2 threads, one worker), one "
        "round per setting, each on a new worker.",
        "",
        "| max_active_jobs | clients | tok/s | TTFT p50 s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {active} | {r.clients} | {r.tok_s:.1f} | {r.ttft_p50:.2f} |" for active, r in rows
    ]
    return "\n".join(lines) + "\n"


# Alternations of the lone-stream comparison; each is a new worker of each kind.
LONE_ROUNDS = 4
LONE_REQUESTS = 4


def decode_rate(replies: list[Reply]) -> float:
    """Tokens per second after the first token, over all replies (prefill left out)."""
    decoding = sum(r.ended - r.first for r in replies if r.first is not None)
    return sum(max(r.tokens - 1, 0) for r in replies) / decoding


def lone_section(settings: Settings, log_dir: Path) -> str:
    """One client, the one-job engine and the Conclave taking turns on new workers.

    The 1-client row of the Conclave section runs each system once, minutes apart; this host's
    speed drifted by more than the difference sought between such runs (0.85-1.13x in four), so
    here the two alternate and the ratio is taken within each pair.
    """
    one_job, conclave = RUNS[0], RUNS[1]
    pairs = []
    ttfts: tuple[list[float], list[float]] = ([], [])
    for k in range(LONE_ROUNDS):
        rates = []
        for j, run in enumerate((one_job, conclave)):
            offset = 200_000 + k * 1000 + j * 100
            with granary(settings, log_dir, run, None) as (url, _pid):
                asyncio.run(_at_once(url, [prompt(offset + 99)], 4))  # warm-up
                texts = [[prompt(offset + i) for i in range(LONE_REQUESTS)]]
                replies = asyncio.run(_clients(url, texts, MAX_TOKENS))
            rates.append(decode_rate(replies))
            ttfts[j].extend(r.ttft for r in replies)
        pairs.append((rates[0], rates[1]))
    ratios = [c / o for o, c in pairs]
    ttft_one_job, ttft_conclave = (statistics.median(t) for t in ttfts)
    lines = [
        "## One client: the Conclave against one job at a time",
        "",
        f"`bench/conclave.py`: one client sends {LONE_REQUESTS} streaming chats one after the "
        f"other (distinct ~115-token prompts, {MAX_TOKENS} tokens, greedy; Qwen2.5-0.5B, 2 "
        "threads). Decode tok/s: tokens after the first over the time after the first, so "
        f"prefill is left out. {LONE_ROUNDS} pairs, each a new worker of each kind in turn "
        "(`max_active_jobs` 1, then 8); the ratio is taken within a pair. Target: ≥ 0.97×.",
        "",
        "| pair | one job at a time tok/s | Conclave (exact, default) tok/s | Conclave / one job |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k + 1} | {o:.1f} | {c:.1f} | {c / o:.2f}× |" for k, (o, c) in enumerate(pairs)]
    lines += [
        "",
        f"Median of the pairs' ratios: **{statistics.median(ratios):.2f}×**. Time to first "
        f"token, median of all {LONE_ROUNDS * LONE_REQUESTS} requests of each: one job at a "
        f"time {ttft_one_job:.2f} s, the Conclave {ttft_conclave:.2f} s "
        f"({ttft_conclave / ttft_one_job:.2f}×).",
    ]
    return "\n".join(lines) + "\n"
