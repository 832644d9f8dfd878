"""Identical requests answered from a finished job's result.

A greedy or explicitly seeded request decides its output: the same model, context and prefill
chunking given the same rendered prompt and sampling write the same tokens (restored prefixes
equal cold ones, and a row decoded beside others is decided again as a lone run decides it, see
docs/ARCHITECTURE.md). So the API looks such a request up after rendering it and before
enqueueing it (`shared.submission`); a hit becomes a job that is finished at once, its event
stream the recorded run's events. The worker stores an entry when a job finishes normally and
its run was reproducible (`worker.tasks`), and only when the worker's own identity is the one
the API keyed the request with.

Entries are JSON under a cryptographic digest of a canonical JSON of everything that decides
the output; bounded by a TTL from recording and a count (least recently used go first).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from pydantic import BaseModel
from redis import Redis

from shared import codec, keys
from shared.job_store import JobEvent, JobStore
from shared.prefix_cache import configured_fingerprint
from shared.schemas import (
    Answer,
    AnswerEvent,
    ExtractionResult,
    ExtractOrder,
    JobResult,
    JobStatus,
    ResultKey,
    Timings,
    Usage,
    WorkOrder,
)
from shared.scripts import Scripts
from shared.settings import ResultCacheSettings, Settings

# Bumped when what a key covers changes, so old entries are never read under new rules.
# 2: answers hold every token's text (before, a piece over 32 bytes was dropped).
KEY_VERSION = 2


def identity(settings: Settings, fingerprint: str) -> str:
    """What decides output besides the request, as this process is configured.

    The fingerprint covers weights, KV type and the llama.cpp build; `n_ctx` caps the tokens
    a prompt leaves room for; `block_tokens` is where prefill chunks end (chunking changes
    rounding). No worker setting is here: every worker runs the one engine, whose greedy or
    seeded output does not depend on how many jobs it serves at once, nor on its threads; a
    run that may have (`worker.exact_batching` off) is not stored at all.
    """
    material = {
        "model": fingerprint,
        "n_ctx": settings.n_ctx,
        "block_tokens": settings.cache.block_tokens,
    }
    return _digest(material)


def result_key(
    order: WorkOrder | ExtractOrder, identity: str, *, explicit_seed: bool
) -> ResultKey | None:
    """The key of an order whose output is determined; None for a sampled order whose seed
    the API drew (its output is meant to differ from any other's).

    Greedy output does not read top_p or the seed, so they are left out and greedy requests
    differing only there share a result. `speculation` is left out too: drafts are verified
    by rows computed as alone, so output with drafting is plain decoding's.
    """
    greedy = order.temperature == 0
    if not greedy and not explicit_seed:
        return None
    sampling: dict[str, Any] = {"temperature": 0.0}
    if not greedy:
        sampling = {"temperature": order.temperature, "top_p": order.top_p, "seed": order.seed}
    material = {
        "v": KEY_VERSION,
        "identity": identity,
        "namespace": order.cache_namespace,
        "max_tokens": order.max_tokens,
        "stop": order.stop,
        "sampling": sampling,
        **_input(order),
    }
    return ResultKey(digest=_digest(material), identity=identity)


def _input(order: WorkOrder | ExtractOrder) -> dict[str, Any]:
    if isinstance(order, WorkOrder):
        # The text the model reads and how it is tokenized (control spans, the prefix end):
        # everything a request's prompt, messages, document and special_tokens decided.
        return {"kind": "generate", "prompt": order.prompt.model_dump(mode="json")}
    extract = {
        "kind": "extract",
        "document": order.document.model_dump(mode="json"),  # already normalised
        "questions": [q.model_dump(mode="json") for q in order.questions],
        "fields": order.fields,
    }
    # One answer per question keeps the keys results were stored under before votes existed.
    return extract if order.samples == 1 else {**extract, "samples": order.samples}


def _digest(material: dict[str, Any]) -> str:
    return hashlib.blake2b(codec.dumps(material), digest_size=32).hexdigest()


class Entry(BaseModel):
    """A finished run: its events in order (without the final `done`), result and usage."""

    events: list[tuple[str, str]]
    result: JobResult | None = None
    extraction: ExtractionResult | None = None
    usage: Usage


def entry_of(
    events: list[JobEvent],
    result: JobResult | ExtractionResult,
    usage: Usage,
) -> Entry | None:
    """The entry for a finished job's stream, or None when the stream is not whole (a publish
    that failed loses its tokens from the stream, never from the result)."""
    body = [e for e in events if not e.final]
    whole = [e.seq for e in body] == list(range(len(body)))
    if not whole or len(events) != len(body) + 1 or events[-1].event != "done":
        return None
    is_text = isinstance(result, JobResult)
    return Entry(
        events=[(e.event, e.data) for e in body],
        result=result if is_text else None,
        extraction=None if is_text else result,
        usage=usage,
    )


def open_results(redis: Redis, settings: Settings) -> ResultCache | None:
    """The configured result store (None when disabled), keyed with this process's identity."""
    if not settings.result_cache.enabled:
        return None
    fingerprint = configured_fingerprint(settings)
    return ResultCache(redis, settings.result_cache, identity(settings, fingerprint))


class ResultCache:
    """Lookups (the API) and records (workers) of finished results in Redis."""

    def __init__(self, redis: Redis, settings: ResultCacheSettings, identity: str) -> None:
        self._redis = redis
        self._settings = settings
        self.identity = identity
        self._scripts = Scripts(redis)

    def key_for(
        self, order: WorkOrder | ExtractOrder, *, explicit_seed: bool, wanted: bool
    ) -> ResultKey | None:
        """The order's key, or None when it must not be looked up or stored."""
        if not (self._settings.enabled and wanted):
            return None
        return result_key(order, self.identity, explicit_seed=explicit_seed)

    def lookup(self, key: ResultKey) -> Entry | None:
        raw: bytes | None = self._redis.get(keys.result_entry(key.digest))  # type: ignore[assignment]
        with self._redis.pipeline(transaction=False) as pipe:
            if raw is None:
                pipe.zrem(keys.result_index(), key.digest)  # expired: not counted any more
            else:
                pipe.zadd(keys.result_index(), {key.digest: time.time()}, xx=True)
            name = "result_cache_misses" if raw is None else "result_cache_hits"
            pipe.hincrby(keys.metrics_counters(), name, 1)
            pipe.execute()
        return None if raw is None else Entry.model_validate_json(raw)

    def record(self, key: ResultKey, entry: Entry) -> bool:
        """Store `entry` under `key` unless this process would not give the keyed output, or
        the entry is over the size limit."""
        if key.identity != self.identity:
            return False
        data = entry.model_dump_json().encode()
        if len(data) > self._settings.max_entry_bytes:
            return False
        self._scripts.record_result(
            (keys.result_entry(key.digest), keys.result_index()),
            data,
            self._settings.ttl_s,
            time.time(),
            self._settings.max_entries,
            key.digest,
            keys.result_entry(""),
        )
        self._redis.hincrby(keys.metrics_counters(), "result_cache_stored", 1)
        return True


def answer(store: JobStore, job_id: str, created_at: float, entry: Entry) -> None:
    """Finish a just-created job with a stored run: the same events, result and usage, marked
    `cached_result`, with its own timings (no restore, prefill or decode happened)."""
    started_at = time.time()
    store.start(job_id)
    events = [(name, _cached_event(name, data)) for name, data in entry.events]
    if events:
        store.emit_recorded(job_id, events)
    ttft_ms = (time.time() - created_at) * 1000 if events else None
    store.finish(
        job_id,
        JobStatus.FINISHED,
        result=entry.result,
        extraction=_cached_extraction(entry.extraction),
        usage=_cached(entry.usage),
        timings=Timings(queued_ms=(started_at - created_at) * 1000, ttft_ms=ttft_ms),
    )


def _cached(usage: Usage) -> Usage:
    return usage.model_copy(update={"cached_result": True})


def _cached_event(name: str, data: str) -> bytes:
    """An extraction's `answer` event says, like the job, that the answer was stored; its
    recorded timings were another job's."""
    if name != "answer":
        return data.encode()
    event = AnswerEvent.model_validate_json(data)
    event = event.model_copy(update={"answer": _cached_answer(event.answer)})
    return event.model_dump_json().encode()


def _cached_extraction(result: ExtractionResult | None) -> ExtractionResult | None:
    if result is None:
        return None
    answers = {qid: _cached_answer(a) for qid, a in result.answers.items()}
    return result.model_copy(update={"answers": answers})


def _cached_answer(answer: Answer) -> Answer:
    return answer.model_copy(update={"usage": _cached(answer.usage), "timings": Timings()})
