"""Batches: many extraction requests, one job each on the `batch` queue, tracked together.

A batch is a record and an ordered list of (custom_id, job id); everything else is the jobs'
own records, so a batch's counts and results are always what its jobs say. One item's failure
(at submission, e.g. a document too long, or while running) fails that item only.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator

from redis import Redis

from shared import codec, keys
from shared.errors import GranaryError, JobNotFound
from shared.job_store import JobStore
from shared.queues import BATCH
from shared.schemas import (
    BatchItem,
    BatchResultLine,
    BatchView,
    ExtractionRequest,
    JobStatus,
    JobView,
    Usage,
)
from shared.submission import Submitter

# Jobs read per pipelined round trip: results stream out without holding every item at once.
_READ_CHUNK = 500
# Batch counts use the names batch users expect for job statuses.
_COUNT_NAMES = {
    JobStatus.QUEUED: "queued",
    JobStatus.STARTED: "running",
    JobStatus.FINISHED: "succeeded",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
}


class Batches:
    def __init__(self, redis: Redis, store: JobStore, submitter: Submitter, ttl_s: int) -> None:
        self._redis = redis
        self._store = store
        self._submitter = submitter
        self._ttl_s = ttl_s

    def create(self, items: list[BatchItem], owner: str | None) -> BatchView:
        batch_id = uuid.uuid4().hex
        entries = [(item.custom_id, self._submit(item, owner)) for item in items]
        with self._redis.pipeline() as pipe:
            record = {"id": batch_id, "owner": owner or "", "created_at": time.time()}
            pipe.hset(keys.batch(batch_id), mapping=record)  # type: ignore[arg-type]
            pipe.rpush(keys.batch_items(batch_id), *(codec.dumps(e) for e in entries))
            pipe.expire(keys.batch(batch_id), self._ttl_s)
            pipe.expire(keys.batch_items(batch_id), self._ttl_s)
            pipe.execute()
        return self.get(batch_id, owner)

    def _submit(self, item: BatchItem, owner: str | None) -> str:
        request = ExtractionRequest.model_validate(item.model_dump(exclude={"custom_id"}))
        try:
            return self._submitter.submit(request, queue_name=BATCH, owner=owner).id
        except GranaryError as exc:  # this item cannot run; the others still do
            return self._submitter.failed(request, BATCH, owner, exc.message).id

    def get(self, batch_id: str, owner: str | None) -> BatchView:
        record = self._record(batch_id, owner)
        jobs = [view for _, view in self._jobs(batch_id)]
        counts = Counter(_COUNT_NAMES[view.status] for view in jobs)
        ended = [view.finished_at or 0.0 for view in jobs if view.status.terminal]
        return BatchView(
            id=batch_id,
            created_at=float(record[b"created_at"]),
            finished_at=max(ended) if ended and len(ended) == len(jobs) else None,
            total=len(jobs),
            counts={name: counts.get(name, 0) for name in _COUNT_NAMES.values()},
            usage=Usage(
                prompt_tokens=sum(v.usage.prompt_tokens for v in jobs),
                cached_tokens=sum(v.usage.cached_tokens for v in jobs),
                completion_tokens=sum(v.usage.completion_tokens for v in jobs),
            ),
        )

    def results(self, batch_id: str, owner: str | None) -> Iterator[BatchResultLine]:
        """One line per item, in submission order, whatever state it is in."""
        self._record(batch_id, owner)
        for custom_id, view in self._jobs(batch_id):
            yield BatchResultLine(
                custom_id=custom_id,
                job_id=view.id,
                status=view.status,
                extraction=view.extraction,
                usage=view.usage if view.status.terminal else None,
                error=view.error,
            )

    def cancel(self, batch_id: str, owner: str | None) -> BatchView:
        """Cancel every item not yet ended; finished items keep their results."""
        self._record(batch_id, owner)
        for _, view in self._jobs(batch_id):
            if not view.status.terminal:
                self._submitter.cancel(view.id, owner)
        return self.get(batch_id, owner)

    def _record(self, batch_id: str, owner: str | None) -> dict[bytes, bytes]:
        record: dict[bytes, bytes] = self._redis.hgetall(keys.batch(batch_id))  # type: ignore[assignment]
        if not record or record.get(b"owner", b"").decode() != (owner or ""):
            raise JobNotFound(f"no batch with id {batch_id!r}")
        return record

    def _jobs(self, batch_id: str) -> Iterator[tuple[str, JobView]]:
        """Items in submission order, read `_READ_CHUNK` jobs per round trip."""
        raw: list[bytes] = self._redis.lrange(keys.batch_items(batch_id), 0, -1)  # type: ignore[assignment]
        entries: list[tuple[str, str]] = [tuple(codec.loads(entry)) for entry in raw]
        for start in range(0, len(entries), _READ_CHUNK):
            chunk = entries[start : start + _READ_CHUNK]
            views = self._store.get_many([job_id for _, job_id in chunk])
            for (custom_id, _), view in zip(chunk, views, strict=True):
                if view is not None:  # None: expired with its result TTL
                    yield custom_id, view
