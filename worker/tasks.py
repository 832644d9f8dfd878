"""The job function rq runs, by name (`worker.tasks.run_job`), inside a resident worker.

rq resolves a job to a module-level function; the model behind it lives in the worker process
and is bound once at start (`bind`), never loaded per job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from redis import Redis
from rq import get_current_job
from rq.job import Job

from shared import keys
from shared.counter_deltas import CounterPublisher
from shared.job_metrics import record_job, record_speculation, record_votes
from shared.job_store import JobStore
from shared.prefix_usage import PrefixUsage
from shared.queues import QUEUES, queue
from shared.redis_outage import REDIS_DOWN, RedisWaiter
from shared.result_cache import ResultCache, entry_of
from shared.schemas import (
    DocumentFields,
    ExtractionResult,
    ExtractOrder,
    JobResult,
    JobStatus,
    ResultKey,
    Usage,
    WarmOrder,
    WarmResult,
    WorkOrder,
)
from shared.warm_runs import WarmRuns
from worker.conclave.engine import ConclaveEngine
from worker.outcomes import Extracted, Generation
from worker.resume import NOTHING, Streamed, read_back
from worker.token_publisher import TokenPublisher

log = logging.getLogger(__name__)

Outcome = TypeVar("Outcome")
Work = Callable[[str, TokenPublisher, Streamed], Outcome]


class Runtime:
    """What a worker process holds for its whole life: the model and the job store."""

    def __init__(
        self,
        engine: ConclaveEngine,
        redis: Redis,
        store: JobStore,
        warm_runs: WarmRuns,
        stream_interval_s: float,
        waiter: RedisWaiter,
        counters: CounterPublisher | None = None,
        results: ResultCache | None = None,
        warm_steps_aside: bool = False,
    ) -> None:
        self.engine = engine
        self._redis = redis
        # Every write of a job's outcome waits out a Redis outage: the job ends after it.
        self._waiter = waiter
        self.store = store
        self._warm_runs = warm_runs
        self._usage = PrefixUsage(redis)
        self._stream_interval_s = stream_interval_s
        self._counters = counters
        self._results = results
        # One job at a time: a warm job holds the only slot, so it gives way to waiting jobs.
        self._warm_steps_aside = warm_steps_aside

    def run(self, job_id: str) -> None:
        """A generation job: one prompt, one answer."""
        outcome = self._execute(job_id, self._generate)
        if outcome is not None:
            order, done = outcome
            cancelled = done.result.finish_reason == "cancelled"
            self._finish(job_id, cancelled, done, order.result_key)
            if order.document is not None and done.prefix_tokens is not None:
                self._record_prefix_use(order.document, order.cache_namespace, done)

    def extract(self, job_id: str) -> None:
        """An extraction job: many questions about one document, decoded together."""
        outcome = self._execute(job_id, self._extract)
        if outcome is not None:
            order, done = outcome
            cancelled = any(a.finish_reason == "cancelled" for a in done.result.answers.values())
            self._finish(job_id, cancelled, done, order.result_key)
            self._record_prefix_use(order.document, order.cache_namespace, done)

    def _generate(
        self, job_id: str, publisher: TokenPublisher, streamed: Streamed
    ) -> tuple[WorkOrder, Generation]:
        order = self._waiter.call(lambda: self.store.order(job_id, WorkOrder))
        tokens = streamed.of(None)
        return order, self.engine.generate(order, publisher.token, tokens, _priority())

    def _extract(
        self, job_id: str, publisher: TokenPublisher, streamed: Streamed
    ) -> tuple[ExtractOrder, Extracted]:
        order = self._waiter.call(lambda: self.store.order(job_id, ExtractOrder))
        return order, self.engine.extract(order, publisher, streamed, _priority())

    def _execute(self, job_id: str, work: Work[Outcome]) -> Outcome | None:
        """Start the job and run `work`; a failure fails the job, never the worker."""
        attempt = self._waiter.call(lambda: self.store.start(job_id))
        if not attempt:
            log.info("job %s was cancelled or finished before it started; skipping", job_id)
            return None
        try:
            streamed = self._waiter.call(lambda: self._streamed(job_id)) if attempt > 1 else NOTHING
            publisher = TokenPublisher(
                self.store, job_id, self._stream_interval_s, self._waiter, streamed.next_index
            )
            with publisher:
                return work(job_id, publisher, streamed)
        except Exception as exc:
            self._fail(job_id, exc)
            return None

    def _streamed(self, job_id: str) -> Streamed:
        """What the job's earlier attempts published, to carry on from (worker/resume.py)."""
        found = read_back(self.store.events(job_id))
        if found is None:
            log.info("job %s runs again from the start: its stream cannot be carried on", job_id)
            return NOTHING
        log.info("job %s carries on after %d streamed tokens", job_id, found.resumed_tokens)
        return found

    def _fail(self, job_id: str, exc: Exception) -> None:
        log.exception("job %s failed", job_id)  # its streams' half-written cells are dropped
        error = f"{type(exc).__name__}: {exc}"
        self._waiter.call(lambda: self.store.finish(job_id, JobStatus.FAILED, error=error))

    def _finish(
        self, job_id: str, cancelled: bool, done: Generation | Extracted, key: ResultKey | None
    ) -> None:
        """The finish script ends a job once; repeating this after a failure re-stores nothing
        (storing its result again writes the same entry)."""
        self._waiter.call(partial(self._record, job_id, cancelled, done, key))

    def _record(
        self, job_id: str, cancelled: bool, done: Generation | Extracted, key: ResultKey | None
    ) -> None:
        result, usage, speculation = done.result, done.usage, done.speculation
        view = self.store.get(job_id)
        queued_ms = ((view.started_at or view.created_at) - view.created_at) * 1000
        timings = done.timings.model_copy(update={"queued_ms": queued_ms})
        status = JobStatus.CANCELLED if cancelled else JobStatus.FINISHED
        if self._counters is not None:  # before the job ends: whoever sees it sees its counts
            self._counters.publish()
        self.store.finish(
            job_id,
            status,
            result=None if isinstance(result, ExtractionResult) else result,
            extraction=result if isinstance(result, ExtractionResult) else None,
            speculation=speculation,
            usage=usage,
            timings=timings,
        )
        # Not stored: a run whose output may depend on what ran beside it (decided beside other
        # rows without exactness for them), and a resumed job's tokens from two attempts.
        if key is not None and done.reproducible and not cancelled and not usage.resumed_tokens:
            self._store_result(job_id, key, result, usage)
        record_job(self._redis, usage, timings)
        if speculation is not None:
            record_speculation(self._redis, speculation)
        if isinstance(result, ExtractionResult) and not cancelled:
            record_votes(self._redis, result)

    def _store_result(
        self, job_id: str, key: ResultKey, result: JobResult | ExtractionResult, usage: Usage
    ) -> None:
        """Only a job the finish script left `finished` (not cancelled or failed meanwhile)."""
        if self._results is None:
            return
        events = self.store.finished_events(job_id)
        entry = None if events is None else entry_of(events, result, usage)
        if entry is not None:
            self._results.record(key, entry)

    def _record_prefix_use(
        self, document: DocumentFields, namespace: str | None, done: Generation | Extracted
    ) -> None:
        """Whether the job found its document's prefix computed (what the warmer learns from)."""
        hit = done.usage.cached_tokens >= (done.prefix_tokens or 0)
        self._waiter.call(lambda: self._usage.record(document, namespace, hit=hit))

    def warm(self, job_id: str) -> None:
        """Run a warm job; if other work arrives it steps aside and is queued again."""
        store = self.store
        if not self._waiter.call(lambda: store.start(job_id)):
            return
        order = self._waiter.call(lambda: store.order(job_id, WarmOrder))
        before = self._waiter.call(lambda: store.get(job_id).warm)
        try:
            outcome = self.engine.warm(order, partial(self._should_stop_warm, job_id))
        except Exception as exc:
            self._fail(job_id, exc)
            self._waiter.call(lambda: self._warm_runs.done(order.item, order.cache_namespace))
            return
        result = _accumulate(before, outcome)
        if outcome.yielded and self._waiter.call(lambda: store.requeue(job_id, result)):
            done = result.cached_tokens + result.warmed_tokens
            log.info(
                "warm job %s steps aside at %d of %d tokens", job_id, done, result.prefix_tokens
            )
            self._waiter.call(lambda: self._warm_runs.enqueue(job_id, resume=result.yielded))
            return
        status = JobStatus.CANCELLED if outcome.yielded else JobStatus.FINISHED
        self._waiter.call(lambda: self._end_warm(job_id, status, order, result))

    def _end_warm(
        self, job_id: str, status: JobStatus, order: WarmOrder, result: WarmResult
    ) -> None:
        self.store.finish(job_id, status, warm=result)  # a repeat after a failure does nothing
        self._redis.hincrby(keys.metrics_counters(), "warm_tokens", result.warmed_tokens)
        self._warm_runs.done(order.item, order.cache_namespace)
        if self._counters is not None:
            self._counters.publish()

    def _should_stop_warm(self, job_id: str) -> bool:
        """While a warm job prefills: was it cancelled, or (stepping aside) does a job wait?"""
        try:
            stop = self.store.cancel_requested(job_id)
            if self._warm_steps_aside and not stop:
                stop = any(queue(self._redis, name).count for name in QUEUES[:-1])
        except REDIS_DOWN as exc:  # nobody can be told to wait now: warm on
            self._waiter.failed(exc)
            return False
        self._waiter.succeeded()
        return stop


def _priority() -> int:
    """The job's priority class: the position of its rq queue (interactive first)."""
    job = get_current_job()
    origin = job.origin if job is not None else None
    return QUEUES.index(origin) if origin in QUEUES else 0


def _accumulate(before: WarmResult | None, now: WarmResult) -> WarmResult:
    """A warm job that stepped aside reports its totals across every turn it ran."""
    if before is None:
        return now
    return now.model_copy(
        update={
            "cached_tokens": before.cached_tokens,
            "warmed_tokens": before.warmed_tokens + now.warmed_tokens,
            "already_cached": False,
            "yielded": before.yielded + now.yielded,
        }
    )


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


def run_extract(job_id: str) -> None:
    _bound().extract(job_id)


def run_warm(job_id: str) -> None:
    _bound().warm(job_id)


def on_job_failure(job: Job, _connection: Redis, *exc_info: object) -> None:
    """rq calls this when a job failed outside `run_job`: its worker died mid-job.

    While retries remain rq re-queues the job; after the last one the job is failed for good,
    so clients waiting on its events are told instead of waiting forever.
    """
    job_id = str(job.args[0]) if job.args else job.id  # a resumed warm job has its own rq id
    if job.retries_left:
        log.warning("job %s was abandoned by a dead worker; it will be re-run", job_id)
        return
    _bound().store.finish(job_id, JobStatus.FAILED, error="the worker running this job died")
