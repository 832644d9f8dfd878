"""Job records and their event streams in Redis: the rules of a job's life in one class.

rq moves job ids between queues and registries; this record is what clients see and is the
source of truth for status. Transitions are Lua scripts (`shared.scripts`), so they are atomic.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from redis import Redis

from shared import codec, keys
from shared.errors import JobNotFound
from shared.schemas import (
    AnswerEvent,
    DocumentReport,
    ExtractionResult,
    JobKind,
    JobResult,
    JobStatus,
    JobView,
    SpeculationReport,
    Timings,
    TokenEvent,
    Usage,
    WarmResult,
)
from shared.scripts import Scripts

_JSON_FIELDS = ("result", "warm", "extraction", "speculation", "usage", "timings", "document")
Order = TypeVar("Order", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One entry of a job's event stream: a token, or the final `done` / `error`."""

    seq: int
    event: str
    data: str

    @classmethod
    def from_fields(cls, fields: Mapping[Any, Any]) -> JobEvent:
        """From a stream entry (the client does not decode responses: keys are bytes)."""
        return cls(int(fields[b"seq"]), fields[b"event"].decode(), fields[b"data"].decode())

    @classmethod
    def from_message(cls, payload: bytes) -> list[JobEvent]:
        """One pub/sub message carries one or more events, a "seq|event|data" line each."""
        events = []
        for line in payload.decode().split("\n"):
            seq, event, data = line.split("|", 2)
            events.append(cls(int(seq), event, data))
        return events

    @property
    def final(self) -> bool:
        return self.event in FINAL_EVENTS


FINAL_EVENTS = ("done", "error")


def _event_name(event: TokenEvent | AnswerEvent) -> str:
    return "answer" if isinstance(event, AnswerEvent) else "token"


def _event_keys(job_id: str) -> tuple[str, str, str, str]:
    return (
        keys.job(job_id),
        keys.job_events(job_id),
        keys.job_channel(job_id),
        keys.job_cancel(job_id),
    )


def _final_keys(job_id: str) -> tuple[str, str, str, str, str]:
    return (*_event_keys(job_id), keys.metrics_counters())


class JobStore:
    def __init__(self, redis: Redis, result_ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = result_ttl_s
        self._scripts = Scripts(redis)

    def create(
        self,
        job_id: str,
        queue: str,
        order: BaseModel,
        owner: str | None = None,
        kind: JobKind = "generate",
        document: DocumentReport | None = None,
    ) -> JobView:
        record: dict[str, Any] = {
            "id": job_id,
            "kind": kind,
            "status": JobStatus.QUEUED.value,
            "queue": queue,
            "created_at": time.time(),
            "attempts": 0,
            "emitted": 0,
            "order": order.model_dump_json(),
            "owner": owner or "",
        }
        if document is not None:
            record["document"] = document.model_dump_json()
        with self._redis.pipeline() as pipe:
            # redis-py types `mapping` with an invariant key union no plain dict matches.
            pipe.hset(keys.job(job_id), mapping=record)  # type: ignore[arg-type]
            pipe.hincrby(keys.metrics_counters(), "jobs_submitted", 1)
            pipe.execute()
        return self._view(job_id, record)

    def get(self, job_id: str) -> JobView:
        return self._view(job_id, self._record(job_id))

    def get_owned(self, job_id: str, owner: str | None) -> JobView:
        """The job, for its owner only: to anyone else it does not exist."""
        record = self._record(job_id)
        if record.get("owner", "") != (owner or ""):
            raise JobNotFound(f"no job with id {job_id!r}")
        return self._view(job_id, record)

    def get_many(self, job_ids: list[str]) -> list[JobView | None]:
        """Views in the order given, None for a job that does not exist (any more).

        One pipelined round trip: a batch of thousands of items is read in a few calls,
        not one per item.
        """
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(keys.job(job_id))
            raws: list[dict[bytes, bytes]] = pipe.execute()
        return [
            self._view(job_id, _decoded(raw)) if b"status" in raw else None
            for job_id, raw in zip(job_ids, raws, strict=True)
        ]

    def _record(self, job_id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = self._redis.hgetall(keys.job(job_id))  # type: ignore[assignment]
        if b"status" not in raw:  # none, or only what a late writer left of an expired one
            raise JobNotFound(f"no job with id {job_id!r}")
        return _decoded(raw)

    def discard(self, job_id: str) -> None:
        """Undo `create` for a job never queued (a duplicate): it was never submitted."""
        with self._redis.pipeline() as pipe:
            pipe.delete(keys.job(job_id), keys.job_events(job_id))
            pipe.hincrby(keys.metrics_counters(), "jobs_submitted", -1)
            pipe.execute()

    def order(self, job_id: str, model: type[Order]) -> Order:
        raw = self._redis.hget(keys.job(job_id), "order")
        if raw is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        return model.model_validate_json(raw)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self._redis.exists(keys.job_cancel(job_id)))

    def requeue(self, job_id: str, progress: WarmResult) -> bool:
        """A started job stepped aside for other work: queued again, its progress kept.

        False when it was cancelled meanwhile (it must not be enqueued again).
        """
        return self._scripts.requeue(keys.job(job_id), progress.model_dump_json())

    def start(self, job_id: str) -> int:
        """Mark started; returns the attempt number, or 0 if the job must not run."""
        return self._scripts.start((keys.job(job_id), keys.job_cancel(job_id)), time.time())

    def emit(self, job_id: str, events: list[TokenEvent | AnswerEvent]) -> bool:
        """Publish consecutive events (`token`, `answer`); returns True when the job has been
        cancelled meanwhile."""
        named = [(_event_name(e), e.model_dump_json().encode()) for e in events]
        return self._scripts.emit_events(_event_keys(job_id), events[0].index, named)

    def emit_recorded(self, job_id: str, events: list[tuple[str, bytes]]) -> None:
        """Publish a stored run's events (name, json) from index 0, as its worker did."""
        self._scripts.emit_events(_event_keys(job_id), 0, events)

    def finish(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: JobResult | None = None,
        warm: WarmResult | None = None,
        extraction: ExtractionResult | None = None,
        speculation: SpeculationReport | None = None,
        usage: Usage | None = None,
        timings: Timings | None = None,
        error: str | None = None,
    ) -> bool:
        fields: dict[str, Any] = {}
        values = {
            "result": result,
            "warm": warm,
            "extraction": extraction,
            "speculation": speculation,
            "usage": usage,
            "timings": timings,
        }
        for name, value in values.items():
            if value is not None:
                fields[name] = value.model_dump_json()
        if error is not None:
            fields["error"] = error
        return self._scripts.finish(
            _final_keys(job_id), status.value, time.time(), self._ttl_s, fields
        )

    def cancel(self, job_id: str, owner: str | None = None) -> JobView:
        self.get_owned(job_id, owner)
        self._scripts.cancel(_final_keys(job_id), time.time(), self._ttl_s)
        return self.get(job_id)

    def events(self, job_id: str, after_seq: int = -1) -> list[JobEvent]:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = self._redis.xrange(  # type: ignore[assignment]
            keys.job_events(job_id)
        )
        events = [JobEvent.from_fields(fields) for _, fields in entries]
        return [e for e in events if e.seq > after_seq]

    def finished_events(self, job_id: str) -> list[JobEvent] | None:
        """The whole event stream of a job that finished normally; None for any other status
        (a cancel or failure that won the race with the worker's finish)."""
        with self._redis.pipeline() as pipe:  # MULTI: the status and the stream it ended
            pipe.hget(keys.job(job_id), "status")
            pipe.xrange(keys.job_events(job_id))
            status, entries = pipe.execute()
        if status != JobStatus.FINISHED.value.encode():
            return None
        return [JobEvent.from_fields(fields) for _, fields in entries]

    @staticmethod
    def _view(job_id: str, record: dict[str, Any]) -> JobView:
        data: dict[str, Any] = {k: record[k] for k in JobView.model_fields if k in record}
        for name in _JSON_FIELDS:
            if name in data:
                data[name] = codec.loads(data[name])
        return JobView.model_validate(data)


def _decoded(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}
