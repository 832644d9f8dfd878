"""Many users at once on one worker (the Conclave), side by side with llama.cpp's llama-server.

A: N clients start at the same moment, each streaming two OpenAI chat completions one after
the other (distinct ~115-token prompts, 64 tokens, greedy): total completion tokens per second
of wall time, the median and the slowest of the requests' times to first token (2 to 16
requests: too few for a p95). B: one client asks about a ~3,000-token document; one second
later four short chats arrive: the slowest of their TTFTs, and
the long request's TTFT against its TTFT alone (another document of the same length, so no
cache helps either), measured first in each round.

Every system has the same model file and 2 threads, and all run side by side, asked in turn,
round after round, in an order that rotates (bench/paired.py): granary (API + one worker: one
job at a time (`max_active_jobs` 1), then 8 at once with the kernels `make install` builds,
whose batched rows equal lone ones; then with the stock kernels (`make wheel-stock`), where
exact batching replays near ties, and with `worker.exact_batching` off, which does not; flash
attention on, as llama-server chooses it by itself on a CPU) and `llama-server -np 8 -kvu`
built from the llama.cpp llama-cpp-python vendors (`make peer-server`).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.paired import (
    ForeignCpu,
    foreign_line,
    in_turn,
    no_peer_line,
    per_round,
    ratio_summary,
)
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
LONE_REQUESTS = 12  # one client's lone chats per system, the systems in turn request by request


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
    async for chunk in sse_chunks(client, f"{url}/v1/chat/completions", body):
        choices = chunk.get("choices") or []
        if first is None and choices and (choices[0].get("delta") or {}).get("content"):
            first = time.perf_counter()
        usage = chunk.get("usage") or usage
    if not usage:  # a completed stream ends with its usage; a failed job's had none
        raise RuntimeError(f"{url}: a streamed chat ended without its usage: the request failed")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Reply(
        started,
        first,
        time.perf_counter(),
        usage.get("completion_tokens", 0),
        usage.get("prompt_tokens", 0),
        cached,
    )


async def sse_chunks(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed OpenAI response, as they arrive."""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield orjson.loads(line[6:])


def new_client() -> httpx.AsyncClient:
    """A new connection per request: a pooled one left idle past the server's keep-alive
    timeout (llama-server's is 5 s) can be closed just as a request goes out on it, and the
    request then fails with "Server disconnected" (it did, twice, mid-run)."""
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


async def _at_once(url: str, texts: list[str], max_tokens: int) -> list[Reply]:
    async with new_client() as client:
        return list(await asyncio.gather(*(stream_chat(client, url, t, max_tokens) for t in texts)))


async def _clients(url: str, texts: list[list[str]], max_tokens: int) -> list[Reply]:
    """Each client sends its requests one after another, all clients at once."""

    async def one(client: httpx.AsyncClient, mine: list[str]) -> list[Reply]:
        return [await stream_chat(client, url, t, max_tokens) for t in mine]

    async with new_client() as client:
        replies = await asyncio.gather(*(one(client, mine) for mine in texts))
    return [r for mine in replies for r in mine]


async def _long_and_short(url: str, doc: str, shorts: list[str]) -> tuple[Reply, list[Reply]]:
    question = f"{doc}\n\nWhich shelf holds the most crates of plums? Answer briefly."
    async with new_client() as client:
        long = stream_chat(client, url, question, SHORT_TOKENS)
        others = [stream_chat(client, url, t, SHORT_TOKENS, delay_s=1.0) for t in shorts]
        replies = await asyncio.gather(long, *others)
    return replies[0], list(replies[1:])


@dataclass(frozen=True, slots=True)
class ModelWork:
    """Seconds a granary worker's model spent reading prompt chunks and decode steps, and the
    rows it read (its /metrics)."""

    prompt_s: float
    decode_s: float
    prompt_rows: int
    decode_rows: int

    def __sub__(self, before: ModelWork) -> ModelWork:
        return ModelWork(
            self.prompt_s - before.prompt_s,
            self.decode_s - before.decode_s,
            self.prompt_rows - before.prompt_rows,
            self.decode_rows - before.decode_rows,
        )


def model_work(url: str) -> ModelWork | None:
    """granary's /metrics so far; None for a server without them (llama-server's are off)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    if response.status_code != 200:
        return None
    samples = {
        (sample.name, sample.labels.get("work")): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name in ("granary_model_seconds_total", "granary_model_rows_total")
    }
    if not samples:
        return None
    return ModelWork(
        samples[("granary_model_seconds_total", "prompt")],
        samples[("granary_model_seconds_total", "decode")],
        int(samples[("granary_model_rows_total", "prompt")]),
        int(samples[("granary_model_rows_total", "decode")]),
    )


@dataclass(frozen=True, slots=True)
class LoadRow:
    system: str
    clients: int
    tok_s: float
    ttft_p50: float
    ttft_max: float  # the slowest request's
    wall_s: float = 0.0
    work: ModelWork | None = None  # the model's during the round (granary only)


@dataclass(frozen=True, slots=True)
class MixRow:
    system: str
    short_max: float  # the slowest of the short chats' TTFTs
    long_ttft: float
    long_alone: float
    peak_rss_mb: int  # summed over the system's processes, over both scenarios


def peak_rss_mb(pids: Sequence[int]) -> int:
    """Each process's own peak resident memory, summed: what the system asks of the host
    (granary's API and worker; llama-server is one process)."""
    return sum(_peak_rss_kb(pid) for pid in pids) // 1024


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def load_round(url: str, system: str, n: int, offset: int) -> LoadRow:
    """n clients at once, each sending REQUESTS requests one after the other."""
    texts = [
        [prompt(offset + n * 100 + i * REQUESTS + k) for k in range(REQUESTS)] for i in range(n)
    ]
    before = model_work(url)
    replies = asyncio.run(_clients(url, texts, MAX_TOKENS))
    after = model_work(url)  # each job's counts reach Redis before the job ends
    wall = max(r.ended for r in replies) - min(r.started for r in replies)
    tokens = sum(r.tokens for r in replies)
    ttfts = [r.ttft for r in replies]
    work = None if before is None or after is None else after - before
    return LoadRow(system, n, tokens / wall, statistics.median(ttfts), max(ttfts), wall, work)


def measure(
    url: str, system: str, offset: int, pids: Sequence[int]
) -> tuple[list[LoadRow], MixRow]:
    """Both scenarios against a running server; `offset` keeps prompts unseen by earlier runs."""
    asyncio.run(_at_once(url, [prompt(offset + 999)], 4))  # warm-up: load pages, JIT nothing
    # Alone first, on a worker that has served nothing else, as the one-job engine does.
    alone, _ = asyncio.run(_long_and_short(url, document(offset + 1), []))
    rows = [load_round(url, system, n, offset) for n in CLIENTS]
    shorts = [prompt(offset + 500 + i) for i in range(4)]
    long, others = asyncio.run(_long_and_short(url, document(offset + 2), shorts))
    slowest = max(r.ttft for r in others)
    return rows, MixRow(system, slowest, long.ttft, alone.ttft, peak_rss_mb(pids))


@contextmanager
def granary(
    settings: Settings, log_dir: Path, run: Run, stock_site: Path | None, db: int = 0
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """One stack with its own logs, cache, port and Redis database (its own queues), so
    several run side by side."""
    knobs = {"exact_batching": run.exact, "max_active_jobs": run.active}
    run_dir = Path(tempfile.mkdtemp(dir=log_dir, prefix="conclave-"))
    # A cache of its own: a state another run (or bench) saved would answer a prompt at once.
    cache = {"dir": run_dir / "kv"}
    chosen = settings.model_copy(
        update={
            "worker": settings.worker.model_copy(update=knobs),
            "cache": settings.cache.model_copy(update=cache),
            "redis_url": f"{settings.redis_url}?db={db}",
            "api": settings.api.model_copy(update={"port": free_port()}),
        }
    )
    env = {"PYTHONPATH": str(stock_site)} if run.stock and stock_site is not None else {}
    stack = Stack(chosen, run_dir, env=env)
    try:
        stack.start_api()
        worker = stack.start_worker()
        yield stack.url, (stack.procs["api"].pid, worker.pid)
        # Which way the worker's batched rows were found (worker/conclave/row_check.py).
        if run.active > 1 and f"batched rows {run.rows}" not in stack.log("worker"):
            raise RuntimeError(f"{run.name}: the worker's rows were not found to {run.rows}")
    finally:
        stack.stop()


@contextmanager
def llama_server(
    server: Path, settings: Settings, log_dir: Path
) -> Iterator[tuple[str, tuple[int, ...]]]:
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
        yield f"http://127.0.0.1:{port}", (process.pid,)
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
)


PEER = "llama-server -np 8 -kvu"
ROUNDS = 2
_Row = TypeVar("_Row", "LoadRow", "MixRow")


def section(
    settings: Settings,
    log_dir: Path,
    server: Path | None,
    stock_site: Path | None,
    rounds: int = ROUNDS,
) -> str:
    """Every system runs at once (each granary on a Redis database of its own, so no worker
    takes another's jobs) and is asked in turn, round after round."""
    runs = [r for r in RUNS if stock_site is not None or not r.stock]
    loads: dict[tuple[str, int], list[LoadRow]] = {}
    mixes: dict[str, list[MixRow]] = {}
    foreign: list[float] = []
    peer = server is not None and server.exists()
    peer_failure: str | None = None
    with ExitStack() as running:
        systems = {
            run.name: running.enter_context(granary(settings, log_dir, run, stock_site, db))
            for db, run in enumerate(runs, start=1)
        }
        if server is not None and peer:
            systems[PEER] = running.enter_context(llama_server(server, settings, log_dir))
        for k in range(rounds):
            with ForeignCpu() as cpu:
                for j, (name, (url, pids)) in in_turn(list(enumerate(systems.items())), k):
                    try:
                        rows, mix = measure(url, name, 10_000 * (k * len(systems) + j), pids)
                    except httpx.HTTPError as exc:
                        if name != PEER:
                            raise
                        # The peer failing must not cost granary's rows: it leaves the run.
                        peer_failure = f"{type(exc).__name__}: {exc}; its log ends:\n"
                        peer_failure += _log_tail(log_dir)
                        continue
                    for row in rows:
                        loads.setdefault((name, row.clients), []).append(row)
                    mixes.setdefault(name, []).append(mix)
            foreign.append(cpu.share)
            if peer_failure is not None:
                systems.pop(PEER, None)
        lone = lone_ttfts({name: url for name, (url, _) in systems.items()}, 900_000)
    if peer_failure is not None:
        loads = {key: rows for key, rows in loads.items() if key[0] != PEER}
        mixes.pop(PEER, None)
    text = _render(loads, mixes, foreign, peer=peer and peer_failure is None)
    text += _lone_lines(lone)
    if peer_failure is not None:
        text += f"\nllama-server FAILED during this run:\n\n```\n{peer_failure}\n```\n"
    if stock_site is None:
        text += "\nThe stock kernels were not given (`make wheel-stock`): no rows for them.\n"
    return text


def lone_ttfts(urls: dict[str, str], offset: int) -> dict[str, list[float]]:
    """One client's time to first token, request by request, every system in turn (the order
    rotating): a distinct ~115-token chat each time, LONE_REQUESTS per system."""
    ttfts: dict[str, list[float]] = {name: [] for name in urls}
    for i in range(LONE_REQUESTS):
        for j, (name, url) in in_turn(list(enumerate(urls.items())), i):
            reply = asyncio.run(_at_once(url, [prompt(offset + 100 * i + j)], 2))[0]
            ttfts[name].append(reply.ttft)
    return ttfts


def _lone_lines(lone: dict[str, list[float]]) -> str:
    if PEER not in lone:
        return ""
    lines = [
        "",
        f"One client, one chat at a time, {LONE_REQUESTS} requests per system (distinct ~115-token "
        "chats), the systems in turn request by request: the median TTFT, and its ratio to the "
        "peer's request by request (median and range). Target (issue 32): 1 client TTFT ≤ the "
        "peer's.",
        "",
        "| system | TTFT median s | TTFT vs peer |",
        "|---|---|---|",
    ]
    for name, ttfts in lone.items():
        versus = "–" if name == PEER else ratio_summary(per_round(ttfts, lone[PEER]))
        lines.append(f"| {name} | {statistics.median(ttfts):.3f} | {versus} |")
    return "\n".join(lines) + "\n"


def _render(
    loads: dict[tuple[str, int], list[LoadRow]],
    mixes: dict[str, list[MixRow]],
    foreign: list[float],
    peer: bool,
) -> str:
    lines = [
        "## Many users on one worker (the Conclave)",
        "",
        "`bench/conclave.py`: Qwen2.5-Coder-0.5B, 2 threads, one worker; streaming OpenAI chat, distinct "
        f"~115-token prompts, {MAX_TOKENS} tokens each, greedy; all clients start at once and "
        f"each sends {REQUESTS} requests one after the other. tok/s: completion tokens over the "
        "wall time of the round; TTFT over all its requests. Every system runs side by side "
        f"and is asked in turn (the order rotating), {len(foreign)} rounds: values are medians "
        "over rounds, a ratio to the peer is taken within each round (median and range; "
        "bench/paired.py). "
        "TTFT: the median and the slowest of the round's requests (2 to 16 of them, too few for "
        "a p95). Targets (issue 32): 8 clients ≥ 1.15× the peer's tok/s with the slowest TTFT "
        "(the issue's p95) ≤ the peer's; "
        "1 client TTFT ≤ the peer's.",
        "",
        "| system | clients | tok/s | TTFT p50 s | TTFT slowest s | tok/s vs peer | TTFT p50 vs "
        "peer | TTFT slowest vs peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, clients), rows in loads.items():
        theirs = loads.get((PEER, clients)) if name != PEER else None
        versus = [_versus(rows, theirs, value) for value in (_tok_s, _ttft_p50, _ttft_max)]
        lines.append(
            f"| {name} | {clients} | {_median(rows, _tok_s):.1f} | "
            f"{_median(rows, _ttft_p50):.2f} | {_median(rows, _ttft_max):.2f} | "
            + " | ".join(versus)
            + " |"
        )
    if not peer:
        lines += ["", no_peer_line("column")]
    lines += _work_lines(loads)
    lines += [
        "",
        "A ~3,000-token document question, and four short chats arriving 1 s later "
        f"({SHORT_TOKENS} tokens each). Targets: the short chats' slowest TTFT ≤ 3 s; the long one's "
        "TTFT ≤ 1.0× the peer's (issue 32) and ≤ 1.25× alone. Alone: another document of the "
        "same length, asked first in each round, before the many-client runs; the mixed run "
        "comes after them. Medians over rounds; the long TTFT's ratio to the peer per round.",
        "",
        "| system | short chats' slowest TTFT s | long TTFT s | long vs peer | long alone s | "
        "long / alone | peak RSS MB (all processes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in mixes.items():
        long_vs_peer = "–"
        if name != PEER and PEER in mixes:
            peer_long = [m.long_ttft for m in mixes[PEER]]
            long_vs_peer = ratio_summary(per_round([m.long_ttft for m in runs], peer_long))
        lines.append(
            f"| {name} | {_median(runs, lambda m: m.short_max):.2f} | "
            f"{_median(runs, lambda m: m.long_ttft):.2f} | {long_vs_peer} | "
            f"{_median(runs, lambda m: m.long_alone):.2f} | "
            f"{_median(runs, lambda m: m.long_ttft / m.long_alone):.2f}× | "
            f"{max(m.peak_rss_mb for m in runs)} |"
        )
    lines += ["", foreign_line(foreign)]
    return "\n".join(lines) + "\n"


def _work_lines(loads: dict[tuple[str, int], list[LoadRow]]) -> list[str]:
    """Where granary's rounds went: the model's time inside llama.cpp over the round's wall
    time, split by what it read, and how fast it read (medians over rounds)."""
    lines = [
        "",
        "Where granary's time went (its /metrics around each round): the model's seconds inside "
        "llama.cpp as a share of the round's wall time, by what it read, and the rows (tokens) "
        "it read per second of each.",
        "",
        "| system | clients | model busy | prompt chunks | decode steps | prompt rows/s | "
        "decode rows/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, clients), rows in loads.items():
        measured = [(r.wall_s, r.work) for r in rows if r.work is not None]
        if not measured:
            continue
        lines.append(
            f"| {name} | {clients} | "
            f"{_share(measured, lambda w: w.prompt_s + w.decode_s)} | "
            f"{_share(measured, lambda w: w.prompt_s)} | {_share(measured, lambda w: w.decode_s)} | "
            f"{statistics.median(w.prompt_rows / w.prompt_s for _, w in measured if w.prompt_s):.0f} | "
            f"{statistics.median(w.decode_rows / w.decode_s for _, w in measured if w.decode_s):.0f} |"
        )
    return lines


def _share(measured: list[tuple[float, ModelWork]], seconds: Callable[[ModelWork], float]) -> str:
    return f"{statistics.median(seconds(w) / wall for wall, w in measured):.0%}"


def _tok_s(row: LoadRow) -> float:
    return row.tok_s


def _ttft_p50(row: LoadRow) -> float:
    return row.ttft_p50


def _ttft_max(row: LoadRow) -> float:
    return row.ttft_max


def _versus(
    ours: list[LoadRow], theirs: list[LoadRow] | None, value: Callable[[LoadRow], float]
) -> str:
    if theirs is None:
        return "–"
    return ratio_summary(per_round([value(r) for r in ours], [value(r) for r in theirs]))


def _log_tail(log_dir: Path, lines: int = 12) -> str:
    log = log_dir / "llama-server.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _median(rows: Sequence[_Row], value: Callable[[_Row], float]) -> float:
    return statistics.median(value(r) for r in rows)


def sweep_section(settings: Settings, log_dir: Path) -> str:
    """One round of SWEEP_CLIENTS clients per `max_active_jobs` setting (exact, as by default)."""
    rows = []
    for i, active in enumerate(SWEEP_ACTIVE):
        run = Run(f"max_active_jobs {active}", True, active)
        offset = 100_000 + i * 1000
        with granary(settings, log_dir, run, None) as (url, _pids):
            asyncio.run(_at_once(url, [prompt(offset + 999)], 4))  # warm-up
            rows.append((active, load_round(url, run.name, SWEEP_CLIENTS, offset)))
    lines = [
        "## How many jobs a worker decodes at once",
        "",
        f"`bench/conclave.py`, `worker.max_active_jobs` (default 8): {SWEEP_CLIENTS} clients at "
        f"once, each sending {REQUESTS} requests one after the other (distinct ~115-token chats, "
        f"{MAX_TOKENS} tokens, greedy, exact batching; Qwen2.5-Coder-0.5B, 2 threads, one worker), one "
        "round per setting, each on a new worker.",
        "",
        "| max_active_jobs | clients | tok/s | TTFT p50 s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {active} | {r.clients} | {r.tok_s:.1f} | {r.ttft_p50:.2f} |" for active, r in rows
    ]
    return "\n".join(lines) + "\n"
