"""The named models: what each costs to keep and how fast it reads and writes here.

Each installed named model is served in turn by its own stack (API + one worker, 2 threads,
the defaults): a warm-up request, then a cold ~1,000-token prompt alone (reading: its prompt
tokens over its time to first token, the job path included), then one stream of 128 tokens
continuing an inventory (writing: tokens per second after the first). Memory: the worker's
peak resident set after both. A model whose packages are not installed is named, not
measured. Accuracy: the exam section.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from bench.completions import clients, continued, served
from bench.conclave import document, peak_rss_mb
from shared.errors import ModelUnavailable
from shared.models import NAMED_MODELS, resolve_model
from shared.settings import Settings

DECODE_TOKENS = 128


@dataclass(frozen=True, slots=True)
class Row:
    model: str
    file_mb: int
    worker_rss_mb: int
    prompt_tokens: int
    read_tok_s: float
    write_tok_s: float


def measure(settings: Settings, model: str, path: Path, log_dir: Path) -> Row:
    with served(settings, path, log_dir, db=1) as stack:
        asyncio.run(clients(stack.url, [[continued(9_999)]], 4))  # load pages
        question = f"{document(77_777, lines=30)}\n\nWhich shelf holds the most plums? Shelf"
        (cold,) = asyncio.run(clients(stack.url, [[question]], 4))
        (stream,) = asyncio.run(clients(stack.url, [[continued(1)]], DECODE_TOKENS))
        rss = peak_rss_mb([stack.procs["worker"].pid])
    return Row(
        model,
        path.stat().st_size // 1_000_000,
        rss,
        cold.prompt_tokens,
        cold.prompt_tokens / cold.ttft,
        stream.decode_rate(),
    )


def section(settings: Settings, log_dir: Path) -> str:
    rows, missing = [], []
    for model, named in NAMED_MODELS.items():
        try:
            path = resolve_model(model, settings.data_dir)
        except ModelUnavailable:
            missing.append(f"{model} (`{named.install_hint}`)")
            continue
        rows.append(measure(settings, model, path, log_dir))
    lines = [
        "## Named models",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "",
        "| model | file MB | worker peak RSS MB | cold prompt tokens | reading tok/s "
        "| writing tok/s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.model} | {r.file_mb:,} | {r.worker_rss_mb:,} | {r.prompt_tokens:,} "
        f"| {r.read_tok_s:.0f} | {r.write_tok_s:.1f} |"
        for r in rows
    ]
    if missing:
        lines += ["", f"Not installed, not measured: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"
