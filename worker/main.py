"""`granary worker`: load the model once, then serve the queues until stopped."""

from __future__ import annotations

import logging

from shared.blob_store import DirectoryBlobStore
from shared.fingerprint import model_fingerprint
from shared.job_store import JobStore
from shared.models import resolve_model
from shared.prefix_cache import PrefixCache
from shared.llm import load_llama
from shared.redis_server import connect
from shared.settings import Settings
from worker import tasks
from worker.engine import Engine, memory_is_truncatable
from worker.prefix_saver import PrefixSaver
from worker.worker import GranaryWorker

log = logging.getLogger(__name__)


def build_engine(settings: Settings) -> Engine:
    llama = load_llama(settings)
    block_tokens = settings.cache.block_tokens
    if not settings.cache.enabled:
        return Engine(llama, block_tokens)
    fingerprint = model_fingerprint(resolve_model(settings.model, settings.data_dir), settings.data_dir)
    cache = PrefixCache(
        DirectoryBlobStore(settings.cache_dir),
        fingerprint,
        block_tokens=block_tokens,
        max_bytes=settings.cache.max_bytes,
        truncatable=memory_is_truncatable(llama),
    )
    return Engine(llama, block_tokens, cache, PrefixSaver(cache), settings.cache.min_tokens)


def run_worker(settings: Settings) -> None:
    redis = connect(settings.redis_url)
    engine = build_engine(settings)
    log.info("model %s loaded (%d threads, n_ctx %d)", settings.model, settings.threads, engine.n_ctx)
    tasks.bind(tasks.Runtime(engine, JobStore(redis, settings.jobs.result_ttl_s)))
    GranaryWorker(redis, settings.worker).work(logging_level=settings.log_level)
