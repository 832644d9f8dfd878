"""`granary worker`: load the model once, then serve the queues until stopped."""

from __future__ import annotations

import logging

from shared.cache_counters import CounterPublisher
from shared.job_store import JobStore
from shared.prefix_cache import open_cache
from shared.redis_server import connect
from shared.settings import Settings
from shared.warm_runs import WarmRuns
from worker import tasks
from worker.engine import Engine, memory_is_truncatable
from worker.multi_sequence import load_multi_sequence_llama
from worker.prefix_saver import PrefixSaver
from worker.worker import GranaryWorker

log = logging.getLogger(__name__)


def build_engine(settings: Settings) -> Engine:
    # Sequence 0 holds every job's prompt; extraction questions fork into the others.
    llama = load_multi_sequence_llama(settings, settings.worker.max_sequences + 1)
    block_tokens = settings.cache.block_tokens
    if not settings.cache.enabled:
        return Engine(llama, block_tokens)
    cache = open_cache(settings, truncatable=memory_is_truncatable(llama))
    return Engine(llama, block_tokens, cache, PrefixSaver(), settings.cache.min_tokens)


def run_worker(settings: Settings) -> None:
    redis = connect(settings.redis_url)
    engine = build_engine(settings)
    log.info(
        "model %s loaded (%d threads, n_ctx %d)", settings.model, settings.threads, engine.n_ctx
    )
    store = JobStore(redis, settings.jobs.result_ttl_s)
    counters = CounterPublisher(redis, engine.cache) if engine.cache is not None else None
    interval_s = settings.worker.stream_interval_ms / 1000
    warm_runs = WarmRuns(redis, store, settings)
    tasks.bind(tasks.Runtime(engine, redis, store, warm_runs, interval_s, counters))
    try:
        GranaryWorker(redis, settings.worker).work(logging_level=settings.log_level)
    finally:
        engine.close()
        if counters is not None:  # the snapshots written just now count too
            counters.publish()
