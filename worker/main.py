"""`granary worker`: load the model once, then serve the queues until stopped."""

from __future__ import annotations

import logging
import time

import llama_cpp
from llama_cpp import Llama
from redis import Redis

from shared.job_store import JobStore
from shared.prefix_cache import CounterPublisher, PrefixCache, configured_fingerprint, open_cache
from shared.redis_outage import RedisWaiter
from shared.redis_server import connect
from shared.result_cache import open_results
from shared.settings import Settings
from shared.warm_runs import WarmRuns
from worker import tasks
from worker.conclave.engine import ConclaveEngine
from worker.conclave.loop import Conclave
from worker.conclave.row_check import PAST_PADDED_WINDOW, batched_rows_equal_lone
from worker.decode_batch import fill_batch, llama_batch
from worker.engine import Engine, memory_is_truncatable
from worker.multi_sequence import load_multi_sequence_llama
from worker.prefix_saver import PrefixSaver
from worker.speculation import Speculator
from worker.speculation.archive import DraftArchive
from worker.worker import ConclaveWorker, GranaryWorker

log = logging.getLogger(__name__)


def build_engine(settings: Settings) -> Engine | ConclaveEngine:
    if settings.worker.max_active_jobs > 1:
        return build_conclave(settings)
    return build_one_job_engine(settings)


def warm_up(llama: Llama) -> None:
    """One throwaway decode before the first job, as llama-server makes at start. The weights
    are mapped from the model file, so the first decode after a start takes the page faults of
    every weight it reads (tens of thousands for Qwen2.5-0.5B) and llama.cpp's first-use setup:
    without this, the first request after a restart paid for them in its time to first token.
    The cell is cleared with its data, so no job sees it."""
    started = time.perf_counter()
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    token = max(llama_cpp.llama_vocab_bos(vocab), 0)
    with llama_batch(1) as batch:
        fill_batch(batch, [(token, 0, 0)], logits=True)
        if llama_cpp.llama_decode(llama.ctx, batch) != 0:
            raise RuntimeError("the warm-up decode failed")
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)
    log.info("warmed up in %.0f ms", (time.perf_counter() - started) * 1000)


def build_one_job_engine(settings: Settings) -> Engine:
    # Sequence 0 holds every job's prompt; extraction questions fork into the others.
    llama = load_multi_sequence_llama(settings, settings.worker.max_sequences + 1)
    warm_up(llama)
    block_tokens = settings.cache.block_tokens
    speculator = _speculator(settings)
    if not settings.cache.enabled:
        return Engine(llama, block_tokens, speculator=speculator)
    cache = open_cache(settings, truncatable=memory_is_truncatable(llama))
    return Engine(llama, block_tokens, cache, PrefixSaver(), settings.cache.min_tokens, speculator)


def build_conclave(settings: Settings, rows_invariant: bool | None = None) -> ConclaveEngine:
    """`rows_invariant`: whether batched rows equal lone ones; None checks it on the model."""
    worker = settings.worker
    n_seq = min(
        worker.sequences or worker.max_active_jobs + 4,
        llama_cpp.llama_max_parallel_sequences(),
    )
    llama = load_multi_sequence_llama(settings, n_seq, n_ctx=n_seq * settings.n_ctx, unified=False)
    truncatable = memory_is_truncatable(llama)
    cache = open_cache(settings, truncatable=truncatable) if settings.cache.enabled else None
    saver = PrefixSaver() if cache is not None else None
    namespaced: dict[str, PrefixCache] = {}

    def cache_for(namespace: str | None) -> PrefixCache | None:
        if cache is None or namespace is None:
            return cache
        return namespaced.setdefault(namespace, cache.namespaced(namespace))

    # Flash attention may read a long sequence's lone row otherwise than beside others: the
    # check fills one sequence past the padded window, or as far as a sequence holds.
    long_cells = min(PAST_PADDED_WINDOW, settings.n_ctx - 1) if settings.flash_attn else 0

    def startup() -> bool:
        warm_up(llama)
        if rows_invariant is not None:
            return rows_invariant
        return batched_rows_equal_lone(llama, n_seq, long_cells)

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
    )
    return ConclaveEngine(
        llama, conclave, settings.n_ctx, settings.cache.block_tokens, cache_for, cache, saver
    )


def _speculator(settings: Settings) -> Speculator:
    worker = settings.worker
    path = worker.draft_archive or settings.data_dir / "drafts.sqlite3"
    archive = DraftArchive(path, max_bytes=worker.draft_archive_max_bytes)
    return Speculator(archive, configured_fingerprint(settings), exact=worker.speculation_exact)


def run_worker(settings: Settings) -> None:
    redis = connect(settings.redis_url)
    # Redis going away never ends this process (nor reloads the model): every step waits.
    waiter = RedisWaiter(redis, log)
    engine = build_engine(settings)
    log.info(
        "model %s loaded (%d threads, n_ctx %d, %d jobs at once)",
        settings.model,
        settings.threads,
        engine.n_ctx,
        settings.worker.max_active_jobs,
    )
    store = JobStore(redis, settings.jobs.result_ttl_s)
    counters = CounterPublisher(redis, engine.cache) if engine.cache is not None else None
    interval_s = settings.worker.stream_interval_ms / 1000
    warm_runs = WarmRuns(redis, store, settings)
    results = open_results(redis, settings)
    runtime = tasks.Runtime(engine, redis, store, warm_runs, interval_s, waiter, counters, results)
    tasks.bind(runtime)
    try:
        worker = waiter.call(lambda: _rq_worker(redis, settings, waiter, engine))
        worker.work(logging_level=settings.log_level)
    finally:
        engine.close()
        if counters is not None:  # the snapshots written just now count too
            counters.publish()


def _rq_worker(
    redis: Redis, settings: Settings, waiter: RedisWaiter, engine: Engine | ConclaveEngine
) -> GranaryWorker:
    if isinstance(engine, ConclaveEngine):
        conclave = engine.conclave
        return ConclaveWorker(
            redis,
            settings.worker,
            settings.routing,
            waiter,
            conclave.free_sequences,
            conclave.held_documents,
            conclave.held_changed,
        )
    return GranaryWorker(redis, settings.worker, settings.routing, waiter)
