"""Trimmed vocabularies (`granary model trim`) against the full ones, on the full job path.

Each model is trimmed here (the time is the command's own: read, select, write, check), then
served by one stack per file (API + one worker, 2 threads, flash attention on, the defaults),
all started before the first round and asked in turn, round after round (bench/paired.py):
one client streaming two plain completions one after the other (distinct ~130-token lines of an
inventory that each model writes on, 64 tokens, greedy): decode tokens per second of a stream
after its first token (median); eight clients at once (96 tokens each): pieces per second while
all eight decode; a ~3,000-token document alone: time to first token (cold: each system reads a
new one; trimmed over full, so below 1 is faster). Ratios are trimmed over full,
per round. Tokens: the exam documents (bench/exam_docs, raw) and the shipped held-out text,
tokenized by each vocabulary. The exam (bench/exam.py, `raw` and `facts`) runs the full and
the 32k Qwen.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from llama_cpp import Llama

from bench import exam
from bench.completions import clients, continued, served, together_rate
from bench.conclave import document
from bench.paired import (
    ForeignCpu,
    foreign_line,
    per_round,
    ratio_summary,
)
from shared.llm import quiet_native_logs
from shared.models import resolve_model
from shared.settings import Settings
from shared.vocab_trim import TrimReport, trim_model, trimmed_path

# Sizes per model: the first is the one the targets name; Qwen's 64k keeps the exam's
# languages near the token target.
SIZES = {
    "qwen2.5-coder-0.5b": (32_000, 16_000, 64_000),
    "smollm2-135m": (16_000,),
    "gemma3-270m": (32_000,),
}
MAX_TOKENS = 64
CLIENTS = 8
EIGHT_TOKENS = 96
EXAM_FORMATS = ("raw", "facts")
TARGET_ONE, TARGET_EIGHT, TARGET_TOKENS = 1.18, 1.10, 0.03


@dataclass(frozen=True, slots=True)
class Trimmed:
    model: str
    keep: int
    report: TrimReport
    exam_tokens: tuple[int, int]  # (full, trimmed) over the exam documents


@dataclass(frozen=True, slots=True)
class Speeds:
    one_stream: float  # decode tok/s after the first token, the median of one client's streams
    eight: float  # tok/s of eight streams while all eight decode
    cold_ttft: float  # s, a ~3,000-token document alone
    cold_tokens: int  # that document's prompt tokens


def measure(url: str, offset: int) -> Speeds:
    one = asyncio.run(clients(url, [[continued(offset), continued(offset + 1)]], MAX_TOKENS))
    eight = asyncio.run(
        clients(url, [[continued(offset + 10 + i)] for i in range(CLIENTS)], EIGHT_TOKENS)
    )
    question = f"{document(offset)}\n\nWhich shelf holds the most crates of plums? Shelf"
    (cold,) = asyncio.run(clients(url, [[question]], 8))
    return Speeds(
        one_stream=statistics.median(s.decode_rate() for s in one),
        eight=together_rate(eight),
        cold_ttft=cold.ttft,
        cold_tokens=cold.prompt_tokens,
    )


def trim(settings: Settings, model: str, keep: int, out_dir: Path) -> Trimmed:
    source = resolve_model(model, settings.data_dir)
    report = trim_model(source, trimmed_path(source, keep, out_dir), keep)
    docs = [d.text for d in exam.load()]
    counts = [_count(path, docs) for path in (source, report.target)]
    return Trimmed(model, keep, report, (counts[0], counts[1]))


def _count(path: Path, texts: list[str]) -> int:
    with quiet_native_logs():
        llama = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return sum(len(llama.tokenize(t.encode(), add_bos=False, special=False)) for t in texts)


def speeds(
    settings: Settings, model: str, trims: Sequence[Trimmed], log_dir: Path, rounds: int
) -> tuple[dict[str, list[Speeds]], list[float]]:
    """Each system's speeds per round (`full`, then each trim by its size), and foreign CPU."""
    files = {"full": resolve_model(model, settings.data_dir)}
    files |= {f"{t.keep // 1000}k": t.report.target for t in trims}
    measured: dict[str, list[Speeds]] = {name: [] for name in files}
    foreign = []
    with ExitStack() as running:
        urls = {
            name: running.enter_context(served(settings, path, log_dir, db)).url
            for db, (name, path) in enumerate(files.items(), start=1)
        }
        for url in urls.values():  # load pages, nothing measured
            asyncio.run(clients(url, [[continued(9_999)]], 4))
        for r in range(rounds):
            with ForeignCpu() as cpu:
                for name, url in urls.items():
                    measured[name].append(measure(url, 1_000 * (r + 1)))
            foreign.append(cpu.share)
    return measured, foreign


def section(settings: Settings, log_dir: Path, rounds: int, with_exam: bool = True) -> str:
    out_dir = settings.data_dir / "trims"
    lines = [
        "## A trimmed vocabulary against the full one",
        "",
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()
        + f" {rounds} rounds; a ratio's median and range are over the rounds' own ratios.",
        "",
        "| model | kept tokens | trim s | exam documents' tokens | held-out text's tokens"
        " | 1 stream decode | 8 streams decode | cold ~3,000-token TTFT (its tokens) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes, shares = [], []
    for model, sizes in SIZES.items():
        trims = [trim(settings, model, keep, out_dir) for keep in sizes]
        measured, foreign = speeds(settings, model, trims, log_dir, rounds)
        shares += foreign
        full = measured["full"]
        for t in trims:
            own = measured[f"{t.keep // 1000}k"]
            one = per_round([s.one_stream for s in own], [s.one_stream for s in full])
            eight = per_round([s.eight for s in own], [s.eight for s in full])
            cold = per_round([s.cold_ttft for s in own], [s.cold_ttft for s in full])
            exam_overhead = t.exam_tokens[1] / t.exam_tokens[0] - 1
            lines.append(
                f"| {model} | {t.report.tokens_kept:,} of {t.report.tokens_before:,} "
                f"| {t.report.seconds:.1f} | {t.exam_tokens[0]:,} → {t.exam_tokens[1]:,} "
                f"({exam_overhead:+.1%}) | {t.report.overhead:+.1%} | {ratio_summary(one)} "
                f"| {ratio_summary(eight)} | {ratio_summary(cold)} "
                f"({full[0].cold_tokens:,} → {own[0].cold_tokens:,}) |"
            )
            if t is trims[0] and model == "qwen2.5-coder-0.5b":
                notes += _verdicts(statistics.median(one), statistics.median(eight), exam_overhead)
        speeds_text = ", ".join(
            f"{name} {statistics.median(s.one_stream for s in runs):.1f} / "
            f"{statistics.median(s.eight for s in runs):.1f} tok/s"
            for name, runs in measured.items()
        )
        notes.append(f"- {model}: 1 stream / 8 streams (medians): {speeds_text}")
    lines += [
        "",
        *notes,
        "",
        foreign_line(shares),
    ]
    if with_exam:
        lines += ["", _exam(settings, log_dir, out_dir)]
    return "\n".join(lines) + "\n"


def _verdicts(one: float, eight: float, tokens: float) -> list[str]:
    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return [
        f"- Qwen at 32k against the targets: 1 stream {one:.2f}× (≥ {TARGET_ONE}×: "
        f"{verdict(one >= TARGET_ONE)}), 8 streams {eight:.2f}× (≥ {TARGET_EIGHT}×: "
        f"{verdict(eight >= TARGET_EIGHT)}), exam documents' tokens {tokens:+.1%} "
        f"(≤ +{TARGET_TOKENS:.0%}: {verdict(tokens <= TARGET_TOKENS)})"
    ]


def _exam(settings: Settings, log_dir: Path, out_dir: Path) -> str:
    """The exam on the full and the 32k Qwen: scores, critical facts, per format."""
    docs = exam.load()
    model = "qwen2.5-coder-0.5b"
    files = {"full": str(resolve_model(model, settings.data_dir))}
    files["32k"] = str(trimmed_path(Path(files["full"]), 32_000, out_dir))
    lines = [
        "Exam (bench/exam.py, prefix cache off, greedy), Qwen2.5-Coder-0.5B full and at 32k:",
        "",
        "| vocabulary | format | document tokens | score | critical right |",
        "|---|---|---|---|---|",
    ]
    for name, path in files.items():
        chosen = settings.model_copy(
            update={
                "model": path,
                "n_ctx": exam.N_CTX,
                "cache": settings.cache.model_copy(update={"enabled": False}),
            }
        )
        runs = exam.measure(chosen, log_dir, docs, formats=EXAM_FORMATS)
        for fmt in EXAM_FORMATS:
            done = exam.totals([r for r in runs if r.format == fmt])
            lines.append(
                f"| {name} | {fmt} | {done['tokens']:,} | {done['score']}/{done['questions']} "
                f"| {done['critical']}/{done['critical_total']} |"
            )
    return "\n".join(lines)
