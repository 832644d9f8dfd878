"""The job function rq runs, by name (`worker.tasks.run_job`), inside a resident worker.

rq resolves a job to a module-level function; the model behind it lives in the worker process
and is bound once at start (`bind`), never loaded per job.
"""

from __future__ import annotations

import logging

from redis import Redis
from rq.job import Job

from shared.cache_counters import CounterPublisher
from shared.job_metrics import record_job
from shared.job_store import JobStore
from shared.schemas import JobStatus
from worker.engine import Engine
from worker.token_publisher import TokenPublisher

log = logging.getLogger(__name__)


class Runtime:
    """What a worker process holds for its whole life: the model and the job store."""

    def __init__(
        self,
        engine: Engine,
        redis: Redis,
        store: JobStore,
        stream_interval_s: float,
        counters: CounterPublisher | None = None,
    ) -> None:
        self.engine = engine
        self._redis = redis
        self.store = store
        self._stream_interval_s = stream_interval_s
        self._counters = counters

    def run(self, job_id: str) -> None:
        store = self.store
        attempt = store.start(job_id)
        if not attempt:
            log.info("job %s was cancelled or finished before it started; skipping", job_id)
            return
        view = store.get(job_id)
        queued_ms = ((view.started_at or view.created_at) - view.created_at) * 1000
        try:
            order = store.order(job_id)
            with TokenPublisher(store, job_id, self._stream_interval_s) as publisher:
                generation = self.engine.generate(order, publisher.put)
        except Exception as exc:  # a job's failure must never take the worker down
            log.exception("job %s failed", job_id)
            self.engine.forget()  # its memory may be half-written: the next job starts clean
            store.finish(job_id, JobStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
            return
        cancelled = generation.result.finish_reason == "cancelled"
        timings = generation.timings.model_copy(update={"queued_ms": queued_ms})
        store.finish(
            job_id,
            JobStatus.CANCELLED if cancelled else JobStatus.FINISHED,
            result=generation.result,
            usage=generation.usage,
            timings=timings,
        )
        record_job(self._redis, generation.usage, timings)
        if self._counters is not None:
            self._counters.publish()


_runtime: Runtime | None = None


def bind(runtime: Runtime) -> None:
    global _runtime
    _runtime = runtime


def _bound() -> Runtime:
    if _runtime is None:
        raise RuntimeError("called outside a granary worker (no model bound)")
    return _runtime


def run_job(job_id: str) -> None:
    _bound().run(job_id)


def on_job_failure(job: Job, _connection: Redis, *exc_info: object) -> None:
    """rq calls this when a job failed outside `run_job`: its worker died mid-job.

    While retries remain rq re-queues the job; after the last one the job is failed for good,
    so clients waiting on its events are told instead of waiting forever.
    """
    if job.retries_left:
        log.warning("job %s was abandoned by a dead worker; it will be re-run", job.id)
        return
    _bound().store.finish(job.id, JobStatus.FAILED, error="the worker running this job died")
