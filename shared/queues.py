"""Everything that crosses rq between the API, the warmer and the workers, in one module.

The queue names in priority order, the dotted names of the job functions and the failure
callback (rq imports them by name in the worker, so the API and the warmer never import worker
code or a model), and the one way to reach a queue and put a job on it.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline
from rq import Callback, Queue, Retry

from shared.codec import JsonSerializer
from shared.settings import Settings

INTERACTIVE = "interactive"
BATCH = "batch"
WARM = "warm"
# Priority order: a worker always drains the earlier ones first.
QUEUES: tuple[str, ...] = (INTERACTIVE, BATCH, WARM)
# Classes whose jobs may go to the worker holding their document (shared/routing.py).
ROUTED: tuple[str, ...] = (INTERACTIVE, BATCH)

RUN_JOB = "worker.tasks.run_job"
RUN_EXTRACT = "worker.tasks.run_extract"
RUN_WARM = "worker.tasks.run_warm"
ON_FAILURE = "worker.tasks.on_job_failure"


def queue(redis: Redis, name: str) -> Queue:
    """A queue as every process sees it: JSON payloads, never pickle."""
    return Queue(name, connection=redis, serializer=JsonSerializer)


def enqueue(
    redis: Redis,
    queue_name: str,
    function: str,
    job_id: str,
    settings: Settings,
    *,
    rq_job_id: str | None = None,
    at_front: bool = False,
    pipeline: Pipeline | None = None,
) -> None:
    """Queue `function(job_id)`: timeouts, retries for abandoned jobs and the failure callback.

    The rq job id is the granary job id unless told otherwise (a warm job that stepped aside
    comes back under a fresh one). With `pipeline`, the commands go into it, unsent.
    """
    worker = settings.worker
    queue(redis, queue_name).enqueue(
        function,
        job_id,
        job_id=rq_job_id or job_id,
        at_front=at_front,
        job_timeout=worker.job_timeout_s,
        result_ttl=settings.jobs.result_ttl_s,
        failure_ttl=settings.jobs.result_ttl_s,
        retry=Retry(max=worker.max_retries) if worker.max_retries else None,
        on_failure=Callback(ON_FAILURE),
        pipeline=pipeline,
    )
