"""A non-forking rq worker that keeps one model resident and its heartbeat fresh.

rq's default worker forks a work horse per job, which would reload the model every time;
`SimpleWorker` runs jobs in-process, but then nothing refreshes the heartbeat while a long
generation runs. A small thread does that, so a job's claim expires quickly only when the
worker is really gone, and another worker re-runs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from redis import Redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.worker import WorkerStatus

from shared.codec import JsonSerializer
from shared.queues import QUEUES, queue
from shared.settings import WorkerSettings

log = logging.getLogger(__name__)


class _Heartbeat:
    """Calls `beat` every `every_s` seconds on a thread until the block exits."""

    def __init__(self, beat: Callable[[], None], every_s: float) -> None:
        self._beat = beat
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self._beat()
            except Exception:  # a missed beat is retried; the job must go on
                log.warning("heartbeat failed", exc_info=True)


class GranaryWorker(SimpleWorker):
    def __init__(self, redis: Redis, settings: WorkerSettings, **kwargs: Any) -> None:
        queues = [queue(redis, name) for name in QUEUES]
        self._heartbeat_ttl_s = settings.heartbeat_ttl_s
        super().__init__(
            queues,
            connection=redis,
            serializer=JsonSerializer,
            # The blocking dequeue wakes this often, so an idle worker notices abandoned jobs.
            worker_ttl=settings.heartbeat_ttl_s + 15,
            maintenance_interval=settings.maintenance_interval_s,
            **kwargs,
        )
        # rq lists a queue once something was enqueued on it; list them from the start, so
        # `rq info` shows all three to an operator checking a fresh deployment.
        redis.sadd(Queue.redis_queues_keys, *(q.key for q in queues))

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        return self._heartbeat_ttl_s

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        beat = lambda: self.maintain_heartbeats(job, execution)  # noqa: E731
        with _Heartbeat(beat, every_s=self._heartbeat_ttl_s / 3):
            self.perform_job(job, queue, execution)
        self.set_state(WorkerStatus.IDLE)
