"""Cache-aware routing with two workers: how many questions find their document in memory.

Two workers (one thread each), four ~1,000-token documents, questions interleaved: each round
asks one question about every document at once, then waits for the four answers. The disk
cache is off, so a question's document can only come from the memory of the worker that runs
it. Measured with `routing.enabled` on and off, each on fresh workers and unseen documents.

This counts, it does not time: it may run while the machine is busy.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from shared.settings import Settings
from tests.harness import Stack

DOCUMENTS = 4
ROUNDS = 5
MAX_TOKENS = 8
# A question's own tokens after its document: a job that prefilled fewer read the document from
# memory.
TAIL_TOKENS = 40
INSTRUCTIONS = "Answer from the ledger only, in a few words."


def document(seed: int) -> str:
    """A ~1,000-token ledger; another seed gives other numbers (nothing shared past the
    instructions)."""
    return "\n".join(
        f"Entry {seed}-{n}: {n * 37 % 91 + seed} sacks of {('oats', 'rye', 'barley')[n % 3]} "
        f"for mill {(n * 7 + seed) % 13}, paid on day {(n * 11 + seed) % 28 + 1}."
        for n in range(40)
    )


def question(round_: int) -> str:
    return f"How many sacks does entry {round_ * 3 + 1} list?"


@dataclass(frozen=True, slots=True)
class Answer:
    document: int
    round: int
    worker: str
    prompt_tokens: int
    cached_tokens: int

    @property
    def from_memory(self) -> bool:
        return self.prompt_tokens - self.cached_tokens <= TAIL_TOKENS


@dataclass(frozen=True, slots=True)
class Row:
    routing: bool
    questions: int  # after each document's first
    from_memory: int
    memory_or_owner: int  # from memory, or on the worker that first read the document
    prefilled_tokens: int  # document and question tokens computed, over those questions
    missed: tuple[tuple[int, int], ...]  # (round, document) of those not served from memory


async def _ask(client: httpx.AsyncClient, url: str, doc: str, text: str) -> str:
    body = {
        "document": doc,
        "instructions": INSTRUCTIONS,
        "prompt": text,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = await client.post(f"{url}/v1/jobs", json=body)
    response.raise_for_status()
    job_id: str = response.json()["id"]
    while True:
        view = (await client.get(f"{url}/v1/jobs/{job_id}")).json()
        if view["status"] in ("finished", "failed", "cancelled"):
            assert view["status"] == "finished", view
            return job_id
        await asyncio.sleep(0.1)


async def _round(url: str, docs: list[str], round_: int) -> list[str]:
    async with httpx.AsyncClient(timeout=600) as client:
        asks = (_ask(client, url, doc, question(round_)) for doc in docs)
        return list(await asyncio.gather(*asks))


def _answer(stack: Stack, client: redis.Redis, job_id: str, doc: int, round_: int) -> Answer:
    usage: dict[str, Any] = httpx.get(f"{stack.url}/v1/jobs/{job_id}").json()["usage"]
    worker: bytes = client.hget(f"rq:job:{job_id}", "worker_name")  # type: ignore[assignment]
    return Answer(doc, round_, worker.decode(), usage["prompt_tokens"], usage["cached_tokens"])


def measure(settings: Settings, log_dir: Path, routing: bool, seed: int) -> Row:
    run = settings.model_copy(
        update={"routing": settings.routing.model_copy(update={"enabled": routing})}
    )
    stack = Stack(run, log_dir)
    client = redis.Redis.from_url(run.redis_url)
    docs = [document(seed + i) for i in range(DOCUMENTS)]
    answers: list[Answer] = []
    try:
        stack.start_api()
        stack.start_worker("worker-1")
        stack.start_worker("worker-2")
        for round_ in range(ROUNDS):
            ids = asyncio.run(_round(stack.url, docs, round_))
            answers += [_answer(stack, client, j, d, round_) for d, j in enumerate(ids)]
    finally:
        stack.stop()
        client.close()
    return _row(routing, answers)


def _row(routing: bool, answers: list[Answer]) -> Row:
    owner = {a.document: a.worker for a in answers if a.round == 0}
    later = [a for a in answers if a.round > 0]
    return Row(
        routing=routing,
        questions=len(later),
        from_memory=sum(a.from_memory for a in later),
        memory_or_owner=sum(a.from_memory or a.worker == owner[a.document] for a in later),
        prefilled_tokens=sum(a.prompt_tokens - a.cached_tokens for a in later),
        missed=tuple((a.round, a.document) for a in later if not a.from_memory),
    )


def section(settings: Settings, log_dir: Path) -> str:
    # Disk cache off: a document can come only from a worker's memory.
    base = settings.model_copy(
        update={"cache": settings.cache.model_copy(update={"enabled": False})}
    )
    rows = []
    for seed, routing in ((1000, False), (2000, True)):
        with tempfile.TemporaryDirectory(dir=log_dir) as run_dir:
            rows.append(measure(base, Path(run_dir), routing, seed))
    return _render(rows, settings)


def _render(rows: list[Row], settings: Settings) -> str:
    lines = [
        "## Routing: two workers, four documents",
        "",
        f"`bench/routing.py`: {settings.model}, two workers of {settings.threads} thread(s), "
        f"disk cache off; {DOCUMENTS} ~1,000-token documents, {ROUNDS} rounds of one question "
        f"per document sent together ({MAX_TOKENS} tokens each). Counted over the questions "
        "after each document's first (the first finds no memory anywhere). Target: ≥ 90% "
        "from memory or the owning worker (the one that first read the document).",
        "",
        "| routing | questions | from a worker's memory | from memory or on the owner | "
        "tokens prefilled |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'on' if r.routing else 'off'} | {r.questions} | "
            f"{r.from_memory} ({r.from_memory / r.questions:.0%}) | "
            f"{r.memory_or_owner} ({r.memory_or_owner / r.questions:.0%}) | "
            f"{r.prefilled_tokens} |"
        )
    lines.append("")
    for r in rows:
        missed = ", ".join(f"round {n} document {d}" for n, d in r.missed) or "none"
        lines.append(f"Not from memory with routing {'on' if r.routing else 'off'}: {missed}.")
    return "\n".join(lines) + "\n"
