"""Warm runs: one trigger (a schedule firing, a catch-up, a request) and the warm jobs it queued.

Every warm job is a job like any other (a record in the job store, events, cancel) on the
`warm` queue, which workers serve only when `interactive` and `batch` are empty. A prefix that
already has a warm job queued or running is not queued twice: the run joins that job. Run
records are kept for the last `MAX_RUNS` runs.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

from pydantic import BaseModel
from redis import Redis

from shared import codec, keys
from shared.errors import JobNotFound
from shared.job_store import JobStore
from shared.prefix_usage import prefix_id
from shared.queues import RUN_WARM, WARM, enqueue
from shared.schemas import JobStatus, JobView, WarmItem, WarmOrder, WarmTrigger
from shared.settings import Settings

MAX_RUNS = 100


class WarmRunJob(BaseModel):
    job_id: str
    name: str | None = None
    # This prefix already had a warm job queued or running; the run waits on that one.
    joined: bool = False


class WarmRunView(BaseModel):
    id: str
    trigger: WarmTrigger
    started_at: float
    finished_at: float | None = None
    counts: dict[str, int]
    # Totals over finished jobs.
    prefix_tokens: int = 0
    warmed_tokens: int = 0
    already_cached: int = 0
    errors: list[str] = []
    jobs: list[JobView] = []


class WarmRuns:
    def __init__(self, redis: Redis, store: JobStore, settings: Settings) -> None:
        self._redis = redis
        self._store = store
        self._settings = settings

    def start(
        self,
        items: list[tuple[WarmItem, str | None]],
        trigger: WarmTrigger,
        *,
        owner: str | None = None,
        errors: list[str] | None = None,
    ) -> WarmRunView:
        """Queue a warm job per (item, cache namespace), joining any already pending; record
        the run."""
        run_id = uuid.uuid4().hex
        jobs = [self._queue_item(item, run_id, ns, owner) for item, ns in items]
        record = {
            "id": run_id,
            "trigger": trigger,
            "owner": owner or "",
            "started_at": time.time(),
            "jobs": codec.dumps([job.model_dump() for job in jobs]),
            "errors": codec.dumps(errors or []),
        }
        with self._redis.pipeline() as pipe:
            pipe.hset(keys.warm_run(run_id), mapping=record)  # type: ignore[arg-type]
            pipe.expire(keys.warm_run(run_id), self._settings.jobs.result_ttl_s)
            pipe.lpush(keys.warm_runs(), run_id)
            pipe.ltrim(keys.warm_runs(), 0, MAX_RUNS - 1)
            pipe.hincrby(keys.metrics_counters(), f"warm_runs_{trigger}", 1)
            pipe.execute()
        return self.get(run_id, owner)

    def get(self, run_id: str, owner: str | None = None) -> WarmRunView:
        raw: dict[bytes, bytes] = self._redis.hgetall(keys.warm_run(run_id))  # type: ignore[assignment]
        if not raw or raw.get(b"owner", b"").decode() != (owner or ""):
            raise JobNotFound(f"no warm run with id {run_id!r}")
        jobs = [WarmRunJob.model_validate(j) for j in codec.loads(raw[b"jobs"])]
        views = []
        for job in jobs:
            try:
                views.append(self._store.get(job.job_id))
            except JobNotFound:  # expired with its result TTL
                continue
        return _summarise(
            run_id,
            raw[b"trigger"].decode(),  # type: ignore[arg-type]
            float(raw[b"started_at"]),
            views,
            codec.loads(raw.get(b"errors", b"[]")),
        )

    def recent(self, owner: str | None = None, limit: int = 20) -> list[WarmRunView]:
        ids: list[bytes] = self._redis.lrange(keys.warm_runs(), 0, MAX_RUNS - 1)  # type: ignore[assignment]
        runs = []
        for raw_id in ids:
            try:
                runs.append(self.get(raw_id.decode(), owner))
            except JobNotFound:
                continue
            if len(runs) == limit:
                break
        return runs

    def _queue_item(
        self, item: WarmItem, run_id: str, namespace: str | None, owner: str | None
    ) -> WarmRunJob:
        pending_key = keys.warm_pending(prefix_id(item, namespace))
        job_id = uuid.uuid4().hex
        ttl_s = self._settings.worker.job_timeout_s
        while not self._redis.set(pending_key, job_id, nx=True, ex=ttl_s):
            existing = self._pending_job(pending_key)
            if existing is not None:
                return WarmRunJob(job_id=existing, name=item.name, joined=True)
            self._redis.delete(pending_key)  # its job ended without clearing it
        order = WarmOrder(item=item, cache_namespace=namespace, run_id=run_id)
        self._store.create(job_id, WARM, order, owner, kind="warm")
        self.enqueue(job_id)
        return WarmRunJob(job_id=job_id, name=item.name)

    def _pending_job(self, pending_key: str) -> str | None:
        raw: bytes | None = self._redis.get(pending_key)  # type: ignore[assignment]
        if raw is None:
            return None
        try:
            view = self._store.get(raw.decode())
        except JobNotFound:
            return None
        return None if view.status.terminal else view.id

    def enqueue(self, job_id: str, *, resume: int = 0) -> None:
        """Put a warm job on the warm queue; a resumed one goes first and gets a fresh rq id."""
        enqueue(
            self._redis,
            WARM,
            RUN_WARM,
            job_id,
            self._settings,
            rq_job_id=job_id if resume == 0 else f"{job_id}-{resume}",
            at_front=resume > 0,
        )

    def done(self, item: WarmItem, namespace: str | None) -> None:
        """A warm job ended: the next request for its prefix queues a new one."""
        self._redis.delete(keys.warm_pending(prefix_id(item, namespace)))


def _summarise(
    run_id: str, trigger: WarmTrigger, started_at: float, views: list[JobView], errors: list[str]
) -> WarmRunView:
    counts = Counter(view.status.value for view in views)
    done = [v for v in views if v.warm is not None and v.status is JobStatus.FINISHED]
    ended = [v.finished_at for v in views if v.finished_at is not None]
    all_ended = len(ended) == len(views)
    return WarmRunView(
        id=run_id,
        trigger=trigger,
        started_at=started_at,
        finished_at=max(ended, default=started_at) if all_ended else None,
        counts={status.value: counts.get(status.value, 0) for status in JobStatus},
        prefix_tokens=sum(v.warm.prefix_tokens for v in done if v.warm),
        warmed_tokens=sum(v.warm.warmed_tokens for v in done if v.warm),
        already_cached=sum(1 for v in done if v.warm and v.warm.already_cached),
        errors=[*errors, *(f"{v.id}: {v.error}" for v in views if v.error)],
        jobs=views,
    )
