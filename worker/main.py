"""`granary worker`: load the model once, then serve the queues until stopped."""

from __future__ import annotations

import hashlib
import logging
from functools import partial

import llama_cpp
from redis import Redis

from shared import keys
from shared.counter_deltas import CounterPublisher, Source
from shared.job_store import JobStore
from shared.prefix_cache import PrefixCache, open_cache
from shared.prefix_cache.fingerprint import cache_fingerprint
from shared.redis_outage import RedisWaiter
from shared.redis_server import connect
from shared.result_cache import open_results
from shared.settings import Settings
from shared.warm_runs import WarmRuns
from worker import tasks
from worker.conclave.engine import ConclaveEngine
from worker.conclave.loop import Conclave
from worker.conclave.row_check import (
    PAST_PADDED_WINDOW,
    KernelFacts,
    batched_rows_equal_lone,
    granule_found,
    prompt_pieces_share_passes,
    remembered,
    rows_found,
    shared_found,
    slice_granule,
)
from worker.kernels import build_stamp, exact_row_limit
from worker.model import load_model, memory_is_truncatable, warm_up
from worker.prefix_saver import PrefixSaver
from worker.restore_cost import RestoreCosts
from worker.save_yield import SaveYield
from worker.worker import ConclaveWorker

log = logging.getLogger(__name__)


def _prefill_key(settings: Settings, llama: llama_cpp.Llama) -> str:
    """What a prefill rate depends on: the model file, build and CPU kernels, the threads."""
    return f"{cache_fingerprint(settings)}|threads={llama.context_params.n_threads}"


def build_conclave(settings: Settings, rows_invariant: bool | None = None) -> ConclaveEngine:
    """`rows_invariant`: whether batched rows equal lone ones; None checks it on the model."""
    worker = settings.worker
    n_seq = min(
        worker.sequences or worker.max_active_jobs + 4,
        llama_cpp.llama_max_parallel_sequences(),
    )
    llama = load_model(settings, n_seq)
    truncatable = memory_is_truncatable(llama)
    cache = open_cache(settings, truncatable=truncatable) if settings.cache.enabled else None
    yielding = SaveYield(settings.cache.save_slowdown_limit, cache) if cache is not None else None
    saver = PrefixSaver(yielding=yielding, accounts=cache) if cache is not None else None
    namespaced: dict[str, PrefixCache] = {}

    def cache_for(namespace: str | None) -> PrefixCache | None:
        if cache is None or namespace is None:
            return cache
        return namespaced.setdefault(namespace, cache.namespaced(namespace))

    # Flash attention may read a long sequence's lone row otherwise than beside others: the
    # check fills one sequence past the padded window, or as far as a sequence holds.
    long_cells = min(PAST_PADDED_WINDOW, settings.n_ctx - 1) if settings.flash_attn else 0

    def startup() -> KernelFacts:
        warm_up(llama)
        if rows_invariant is not None:
            return KernelFacts(rows_invariant)
        kernels = [
            cache_fingerprint(settings),  # the model file, flash attention, the CPU's kernels
            build_stamp(),
            f"exact-rows={exact_row_limit()}",
        ]
        shape = [
            f"threads={llama.context_params.n_threads}",
            f"sequences={n_seq}",
            f"long-cells={long_cells}",
        ]
        record = settings.data_dir / "row-checks.json"
        rows = remembered(
            record,
            _key("rows", *kernels, *shape),
            partial(batched_rows_equal_lone, llama, n_seq, long_cells),
            lambda kept: isinstance(kept, bool),
            rows_found,
        )
        # Where a chunk may be cut depends on the kernels and the passes' splits alone.
        granule = remembered(
            record,
            _key("slices", *kernels, f"batch={llama.n_batch},{llama.context_params.n_ubatch}"),
            partial(slice_granule, llama) if truncatable else lambda: None,
            lambda kept: kept is None or type(kept) is int,
            granule_found,
        )
        shared = remembered(
            record,
            _key("shared", *kernels, f"sequences={n_seq}"),
            partial(prompt_pieces_share_passes, llama),
            lambda kept: isinstance(kept, bool),
            shared_found,
        )
        return KernelFacts(rows, granule, shared)

    conclave = Conclave(
        llama,
        cache_for,
        saver,
        block_tokens=settings.cache.block_tokens,
        min_snapshot_tokens=settings.cache.min_tokens,
        n_seq=n_seq,
        truncatable=truncatable,
        exact=worker.exact_batching,
        startup=startup,
        costs=RestoreCosts(
            settings.cache_dir if cache is not None else None,
            (settings.data_dir / "prefill-rates.json", _prefill_key(settings, llama)),
        ),
        yielding=yielding,
    )
    return ConclaveEngine(llama, conclave, settings.n_ctx, cache, saver)


def _key(check: str, *what_decides: str) -> str:
    digest = hashlib.blake2b("|".join(what_decides).encode(), digest_size=16).hexdigest()
    return f"{check}:{digest}"


def run_worker(settings: Settings) -> None:
    redis = connect(settings.redis_url)
    # Redis going away never ends this process (nor reloads the model): every step waits.
    waiter = RedisWaiter(redis, log)
    engine = build_conclave(settings)
    log.info(
        "model %s loaded (%d threads, n_ctx %d, %d jobs at once)",
        settings.model,
        settings.threads,
        engine.n_ctx,
        settings.worker.max_active_jobs,
    )
    store = JobStore(redis, settings.jobs.result_ttl_s)
    sources: list[Source] = [(keys.metrics_counters(), engine.conclave.model_counters)]
    if engine.cache is not None:
        sources.append((keys.cache_counters(engine.cache.fingerprint), engine.cache.counters))
    counters = CounterPublisher(redis, sources)
    interval_s = settings.worker.stream_interval_ms / 1000
    warm_runs = WarmRuns(redis, store, settings)
    results = open_results(redis, settings)
    steps_aside = settings.worker.max_active_jobs == 1
    runtime = tasks.Runtime(
        engine, redis, store, warm_runs, interval_s, waiter, counters, results, steps_aside
    )
    tasks.bind(runtime)
    try:
        worker = waiter.call(lambda: _rq_worker(redis, settings, waiter, engine, counters))
        worker.work(logging_level=settings.log_level)
    finally:
        engine.close()
        counters.publish()  # the snapshots written just now count too


def _rq_worker(
    redis: Redis,
    settings: Settings,
    waiter: RedisWaiter,
    engine: ConclaveEngine,
    counters: CounterPublisher,
) -> ConclaveWorker:
    conclave = engine.conclave

    def forget() -> None:
        engine.forget()
        counters.publish()  # the snapshots it wrote count now, not at the next job's end

    return ConclaveWorker(
        redis,
        settings.worker,
        settings.routing,
        waiter,
        conclave.free_sequences,
        conclave.held_documents,
        conclave.held_changed,
        forget,
    )
