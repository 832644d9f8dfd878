"""`granary worker`: load the model once, then serve the queues until stopped."""

from __future__ import annotations

import logging

from shared.job_store import JobStore
from shared.llm import load_llama
from shared.redis_server import connect
from shared.settings import Settings
from worker import tasks
from worker.engine import Engine
from worker.worker import GranaryWorker

log = logging.getLogger(__name__)


def run_worker(settings: Settings) -> None:
    redis = connect(settings.redis_url)
    engine = Engine(load_llama(settings))
    log.info("model %s loaded (%d threads, n_ctx %d)", settings.model, settings.threads, engine.n_ctx)
    tasks.bind(tasks.Runtime(engine, JobStore(redis, settings.jobs.result_ttl_s)))
    GranaryWorker(redis, settings.worker).work(logging_level=settings.log_level)
