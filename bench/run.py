"""`make bench`: run every benchmark and write docs/BENCHMARKS.md.

Usage: python -m bench.run [--quick] [--only SUITE [--write]] [--redis URL] [--stock-site DIR]
                            [--invariant-site DIR] [--peer-server PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from bench import (
    attention_rows,
    batch_rows,
    cache_storage,
    chat_document,
    choices,
    chunk_shape,
    cold_prefill,
    conclave,
    edited_document,
    exam,
    extraction,
    first_read,
    job_path,
    machine,
    models,
    normalize_size,
    prefix_cache,
    prompt_kernels,
    restore,
    result_cache,
    routing,
    sheet,
    speculation,
    vocab_trim,
    votes,
    warm,
)
from shared.errors import ModelUnavailable
from shared.models import resolve_model
from shared.redis_server import private_redis
from shared.settings import Settings
from tests.harness import REPO, Stack, free_port

OUT = REPO / "docs" / "BENCHMARKS.md"
DATA_DIR = REPO / ".data" / "bench"


def _settings(redis_url: str, model: str, **extra: object) -> Settings:
    values: dict[str, object] = {
        "redis_url": redis_url,
        "data_dir": DATA_DIR,
        "model": model,
        "n_ctx": 2048,
        "api": {"port": free_port()},
        # The suites measure the worker: a repeated request must run, not come from the store.
        "result_cache": {"enabled": False},
    }
    return Settings(**(values | extra))  # type: ignore[arg-type]


def _job_path_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    rows = []
    for model, max_tokens in (("smollm2-135m", 200), ("qwen2.5-coder-0.5b", 96)):
        # No disk cache: this compares per-token cost, and raw llama-cpp-python has none.
        settings = _settings(redis_url, model, cache={"enabled": False})
        stack = Stack(settings, log_dir)
        try:
            stack.start_api()
            stack.start_worker()
            rows.append(job_path.compare(stack, settings, 2 if quick else 7, max_tokens))
        finally:
            stack.stop()
    return job_path.HEADER + "\n".join(rows) + "\n"


def _prefix_cache_sections(redis_url: str, log_dir: Path, quick: bool) -> list[str]:
    settings = _settings(
        redis_url,
        "qwen2.5-coder-0.5b",
        n_ctx=4096,
        cache={"dir": log_dir / "kv"},
    )
    sizes = {"~1500 tokens": 45, "~3000 tokens": 90}
    rows = prefix_cache.ttft_rows(settings, log_dir, sizes, rounds=1 if quick else 2)
    storage = prefix_cache.storage_section(
        _settings(redis_url, "smollm2-135m"), n_docs=20 if quick else 100
    )
    return [prefix_cache.TTFT_HEADER + "\n".join(rows) + "\n", storage]


def _cache_storage_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return cache_storage.section(
        settings, log_dir, rounds=1 if quick else 3, decode_rounds=1 if quick else 5
    )


def _chat_document_section(redis_url: str, log_dir: Path, server: Path | None) -> str:
    settings = _settings(
        redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, cache={"dir": log_dir / "chat-document-kv"}
    )
    return chat_document.section(settings, log_dir, server, seed=int(time.time()) % 10_000)


def _restore_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096)
    return restore.section(settings, log_dir / "restore-kv", rounds=5 if quick else 15)


def _result_cache_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    # No disk cache: a first run prefills cold in every run of this suite (a cache kept from
    # an earlier run would hold the same prompts).
    settings = _settings(
        redis_url, "smollm2-135m", cache={"enabled": False}, result_cache={"enabled": True}
    )
    return result_cache.section(settings, log_dir, rounds=2 if quick else 5, repeats=5)


def _warm_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    settings = _settings(
        redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, cache={"dir": log_dir / "warm-kv"}
    )
    return warm.section(settings, log_dir, n_items=90, rounds=1 if quick else 3)


def _extraction_section(redis_url: str, log_dir: Path) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return extraction.section(settings, log_dir)


def _exam_section(redis_url: str, log_dir: Path, saved: Path | None) -> str:
    docs = exam.load()
    if saved is not None:  # answers of an earlier run, graded again: no model runs
        settings = _settings(redis_url, exam.MODELS[0], n_ctx=exam.N_CTX, n_threads=2)
        return exam.section(exam.regraded(saved, docs), docs, settings)
    runs: list[exam.Run] = []
    for model in exam.MODELS:
        # Cache off: every run prefills its document cold, so TTFT follows its tokens.
        settings = _settings(
            redis_url, model, n_ctx=exam.N_CTX, n_threads=2, cache={"enabled": False}
        )
        runs += exam.measure(settings, log_dir, docs)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    (DATA_DIR / "exam-answers.json").write_bytes(exam.answers_json(runs, docs))
    (DATA_DIR / "exam-runs.json").write_bytes(exam.runs_json(runs))
    return exam.section(runs, docs, settings)


def _speculation_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    rounds = 1 if quick else 3
    results: dict[str, speculation.Results] = {}
    for model in ("qwen2.5-coder-0.5b", "smollm2-135m", "qwen2.5-coder-1.5b"):
        # Every job decodes: no result store, no cache state carried from another suite.
        settings = _settings(redis_url, model, n_ctx=4096, n_threads=2, cache={"enabled": False})
        stack = Stack(settings, log_dir)
        stack.start()
        try:
            results[model] = speculation.measure(stack, rounds)
        finally:
            stack.stop()
    return speculation.section(2, results, rounds)


def _batch_rows_section(
    redis_url: str, stock_site: Path | None, invariant_site: Path | None
) -> str:
    models = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
    settings = [_settings(redis_url, m) for m in models]
    return batch_rows.section(settings, stock_site, invariant_site)


def _prompt_kernels_section(redis_url: str) -> str:
    models = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
    return prompt_kernels.section([_settings(redis_url, m, n_threads=2) for m in models])


def _attention_rows_section(redis_url: str) -> str:
    return attention_rows.section(
        _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    )


def _chunk_shape_section(redis_url: str) -> str:
    models = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
    return chunk_shape.section([_settings(redis_url, m) for m in models])


def _conclave_section(
    redis_url: str, log_dir: Path, server: Path | None, stock_site: Path | None, quick: bool
) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return conclave.section(settings, log_dir, server, stock_site, rounds=1 if quick else 2)


def _conclave_sweep_section(redis_url: str, log_dir: Path) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return conclave.sweep_section(settings, log_dir)


def _cold_prefill_section(redis_url: str, log_dir: Path, server: Path | None, quick: bool) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return cold_prefill.section(settings, log_dir, server, rounds=1 if quick else 3)


def _edited_document_section(
    redis_url: str, log_dir: Path, server: Path | None, quick: bool
) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return edited_document.section(settings, log_dir, server, rounds=1 if quick else 3)


def _first_read_section(redis_url: str, log_dir: Path, server: Path | None, quick: bool) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return first_read.section(settings, log_dir, server, rounds=1 if quick else 3)


def _vocab_trim_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=2)
    return vocab_trim.section(settings, log_dir, rounds=1 if quick else 3, with_exam=not quick)


def _sheet_section(redis_url: str, log_dir: Path) -> str:
    settings = _settings(
        redis_url, sheet.MODEL, n_ctx=exam.N_CTX, n_threads=2, cache={"enabled": False}
    )
    return sheet.section(settings, log_dir)


def _choices_section(redis_url: str, log_dir: Path, quick: bool) -> str:
    settings = _settings(redis_url, choices.MODEL, n_ctx=4096, n_threads=2)
    return choices.section(settings, log_dir, rounds=1 if quick else 3)


def _votes_sections(redis_url: str, log_dir: Path) -> list[str]:
    """Qwen 0.5B, and the 1.5B where it is installed (`pip install 'granary-llm[qwen15b]'`)."""
    sections = []
    for model in (exam.MODELS[0], exam.MODELS[2]):
        settings = _settings(
            redis_url, model, n_ctx=exam.N_CTX, n_threads=2, cache={"enabled": False}
        )
        try:
            resolve_model(model, settings.data_dir)
        except ModelUnavailable as exc:
            sections.append(f"## Voted extraction answers ({model})\n\nNot measured: {exc}\n")
            continue
        sections.append(votes.section(settings, log_dir))
    return sections


def _models_section(redis_url: str, log_dir: Path) -> str:
    return models.section(_settings(redis_url, "smollm2-135m", n_threads=2), log_dir)


def _routing_section(redis_url: str, log_dir: Path) -> str:
    # Two workers on two cores: one thread each.
    settings = _settings(redis_url, "qwen2.5-coder-0.5b", n_ctx=4096, n_threads=1)
    return routing.section(settings, log_dir)


HEADER = (
    "# Benchmarks\n\nWritten by `make bench` (`bench/run.py`), or one suite at a time by "
    "`python -m bench.run --only SUITE --write`: each section says when and on what host it was "
    "measured, from the code of that day. Timings on shared 2-core machines are noisy and hosts "
    "differ: compare the ratios, each measured side by side within its section.\n\n"
)


def _kept(name: str, suite: Callable[[], list[str]]) -> list[str]:
    """A suite that fails is reported in the document; it never costs the others' results."""
    try:
        return suite()
    except Exception:
        return [f"## {name}: FAILED\n\n```\n{traceback.format_exc()}```\n"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument(
        "--only",
        choices=[
            "job_path",
            "prefix_cache",
            "restore",
            "cache_storage",
            "chat_document",
            "result_cache",
            "warm",
            "extraction",
            "speculation",
            "batch_rows",
            "chunk_shape",
            "prompt_kernels",
            "attention_rows",
            "conclave",
            "conclave_sweep",
            "cold_prefill",
            "first_read",
            "edited_document",
            "routing",
            "exam",
            "vocab_trim",
            "models",
            "choices",
            "sheet",
            "votes",
            "normalize_size",
        ],
        help="one suite, printed, not written (unless --write)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="with --only: put the suite's sections into docs/BENCHMARKS.md in place of its "
        "earlier ones, keeping the others",
    )
    parser.add_argument(
        "--peer-server",
        type=Path,
        help="llama.cpp's llama-server (make peer-server), for conclave, cold_prefill, "
        "first_read, edited_document and chat_document",
    )
    parser.add_argument(
        "--invariant-site",
        type=Path,
        help="llama-cpp-python built batch-invariant (make wheel-invariant), for batch_rows",
    )
    parser.add_argument(
        "--exam-runs",
        type=Path,
        help="with --only exam: grade the answers saved in this exam-runs.json again, run no model",
    )
    parser.add_argument(
        "--stock-site",
        type=Path,
        help="llama-cpp-python built from the sdist unchanged (make wheel-stock), for batch_rows "
        "and conclave",
    )
    parser.add_argument("--redis", help="a Redis URL to use instead of a private redis-server")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        nullcontext(args.redis)
        if args.redis
        else private_redis(Path(tmp) / "redis", persistent=False) as redis_url,
    ):
        log_dir = Path(tmp)
        suites: dict[str, Callable[[], list[str]]] = {
            "job_path": lambda: [_job_path_section(redis_url, log_dir, args.quick)],
            "prefix_cache": lambda: _prefix_cache_sections(redis_url, log_dir, args.quick),
            "restore": lambda: [_restore_section(redis_url, log_dir, args.quick)],
            "cache_storage": lambda: [_cache_storage_section(redis_url, log_dir, args.quick)],
            "chat_document": lambda: [_chat_document_section(redis_url, log_dir, args.peer_server)],
            "result_cache": lambda: [_result_cache_section(redis_url, log_dir, args.quick)],
            "warm": lambda: [_warm_section(redis_url, log_dir, args.quick)],
            "extraction": lambda: [_extraction_section(redis_url, log_dir)],
            "speculation": lambda: [_speculation_section(redis_url, log_dir, args.quick)],
            "batch_rows": lambda: [
                _batch_rows_section(redis_url, args.stock_site, args.invariant_site)
            ],
            "chunk_shape": lambda: [_chunk_shape_section(redis_url)],
            "prompt_kernels": lambda: [_prompt_kernels_section(redis_url)],
            "attention_rows": lambda: [_attention_rows_section(redis_url)],
            "conclave": lambda: [
                _conclave_section(redis_url, log_dir, args.peer_server, args.stock_site, args.quick)
            ],
            "conclave_sweep": lambda: [_conclave_sweep_section(redis_url, log_dir)],
            "cold_prefill": lambda: [
                _cold_prefill_section(redis_url, log_dir, args.peer_server, args.quick)
            ],
            "first_read": lambda: [
                _first_read_section(redis_url, log_dir, args.peer_server, args.quick)
            ],
            "edited_document": lambda: [
                _edited_document_section(redis_url, log_dir, args.peer_server, args.quick)
            ],
            "routing": lambda: [_routing_section(redis_url, log_dir)],
            "exam": lambda: [_exam_section(redis_url, log_dir, args.exam_runs)],
            "vocab_trim": lambda: [_vocab_trim_section(redis_url, log_dir, args.quick)],
            "models": lambda: [_models_section(redis_url, log_dir)],
            "choices": lambda: [_choices_section(redis_url, log_dir, args.quick)],
            "sheet": lambda: [_sheet_section(redis_url, log_dir)],
            "votes": lambda: _votes_sections(redis_url, log_dir),
            "normalize_size": lambda: [normalize_size.section()],
        }
        sections = []
        for name, suite in suites.items():
            if args.only in (None, name):
                measured_on = machine.describe()  # as the suite starts
                sections += [_stamped(section, measured_on) for section in _kept(name, suite)]
    if args.only and args.write:
        text = _replaced(OUT.read_text(), sections)
    elif args.only:
        print("\n".join(sections))
        return
    else:
        text = HEADER + "\n".join(sections)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


def _stamped(section: str, measured_on: str) -> str:
    """A section with the date and host it was measured on, under its title."""
    title, _, body = section.partition("\n")
    return f"{title}\n\n{measured_on}{body.rstrip()}\n"


def _replaced(document: str, sections: list[str]) -> str:
    """`document` with each `## ` section of the same title as one of `sections` replaced by
    it (or the new one appended); the others keep their own dates."""
    old = ["## " + part for part in document.split("\n## ")[1:]]
    for section in sections:
        title = section.split("\n", 1)[0]
        at = [i for i, part in enumerate(old) if part.split("\n", 1)[0] == title]
        if at:
            old[at[0]] = section
        else:
            old.append(section)
    return HEADER + "\n".join(part.rstrip("\n") + "\n" for part in old)


if __name__ == "__main__":
    main()
