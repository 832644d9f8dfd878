"""A non-forking rq worker that keeps one model resident and its heartbeat fresh.

rq's default worker forks a work horse per job, which would reload the model every time;
`SimpleWorker` runs jobs in-process, but then nothing refreshes the heartbeat while a long
generation runs. A small thread does that, so a job's claim expires quickly only when the
worker is really gone, and another worker re-runs it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from redis import Redis
from redis.client import Pipeline, PubSub, PubSubWorkerThread
from rq import Queue, SimpleWorker, worker_registration
from rq.command import parse_payload
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.timeouts import TimerDeathPenalty
from rq.utils import current_timestamp, now
from rq.worker import WorkerStatus

from shared import keys, routing, worker_commands
from shared.codec import JsonSerializer
from shared.queues import QUEUES, ROUTED, WARM, queue
from shared.redis_outage import REDIS_DOWN, RedisWaiter, describe
from shared.settings import RoutingSettings, WorkerSettings
from worker.redis_contact import RedisContact

log = logging.getLogger(__name__)

# How often a Conclave worker advertises for routing and sweeps routed jobs nobody took (and at
# once when what its memory holds, or its room, changes).
TICK_S = 0.5


class _Periodic:
    """Calls `call` on a thread of its own every `every_s` seconds, and at once whenever `wake`
    is set, until stopped. A call that fails is retried at the next round: the job (for a
    heartbeat) or the worker (for routing, an optimisation) goes on."""

    def __init__(
        self,
        call: Callable[[], None],
        every_s: float,
        waiter: RedisWaiter,
        name: str,
        wake: threading.Event | None = None,
    ) -> None:
        self._call = call
        self._every_s = every_s
        self._waiter = waiter
        self._wake = wake or threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> _Periodic:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._every_s)
            self._wake.clear()
            if self._stopped:
                return
            try:
                self._call()
                self._waiter.succeeded()
            except REDIS_DOWN as exc:
                self._waiter.failed(exc)
            except Exception:
                log.warning("%s failed", self._thread.name, exc_info=True)


def _end_loop(thread: PubSubWorkerThread) -> None:
    """Ends the thread's read loop without waiting for it (before redis-py 8.2, `stop()` never
    waited; since, it waits unless given a timeout)."""
    if "timeout" in inspect.signature(thread.stop).parameters:
        thread.stop(timeout=0)
    else:
        thread.stop()


class GranaryWorker(SimpleWorker):
    """rq's work loop quits on a Redis error anywhere outside its dequeue, and a new process
    would load the model again: here each step of the loop waits out an outage instead. How
    jobs run is its subclass's (`ConclaveWorker`)."""

    def __init__(
        self,
        redis: Redis,
        settings: WorkerSettings,
        routing_settings: RoutingSettings,
        waiter: RedisWaiter,
        **kwargs: Any,
    ) -> None:
        queues = [queue(redis, name) for name in QUEUES]
        self._heartbeat_ttl_s = settings.heartbeat_ttl_s
        self._waiter = waiter
        # A stall shorter than half a beat period cannot make a live claim lapse (the beats
        # around it land in time, even at the smallest TTL, 3 s); a longer one is seen as a
        # call that long by the routing round (every TICK_S) or a heartbeat.
        self._contact = RedisContact(settings.heartbeat_ttl_s / 6)
        self._routing = routing.Routing(redis)
        self._wait_s = routing_settings.wait_s
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

    def check_for_suspension(self, burst: bool) -> None:
        self._waiter.call(partial(super().check_for_suspension, burst))

    def run_maintenance_tasks(self) -> None:
        self._waiter.call(super().run_maintenance_tasks)
        self._waiter.call(self._tend_routing)

    def clean_registries(self) -> None:
        """rq's registry maintenance, with jobs judged abandoned only once this worker's calls
        have gone through unstalled for `heartbeat_ttl_s` (worker/redis_contact.py), and as of
        that moment: a maintenance whose own calls then wait out a frozen Redis goes on after
        the thaw, when every claim looks lapsed, and must not judge them by the clock then."""
        cutoff = current_timestamp()
        if self._contact.unbroken_s() < self._heartbeat_ttl_s:
            return  # `last_cleaned_at` stays: the loop's next round asks again
        for q in self.queues:
            if q.acquire_maintenance_lock():  # one worker at a time cleans a queue
                self.log.info("Worker %s: cleaning registries for queue: %s", self.name, q.name)
                self._clean(q, cutoff)
                q.release_maintenance_lock()  # type: ignore[no-untyped-call]
        self.last_cleaned_at = now()  # type: ignore[assignment]  # rq types it by its None

    def _clean(self, queue: Queue, cutoff: int) -> None:
        """rq's `clean_registries(queue)` for the registries granary fills (no dependencies, no
        rate limits), the started one judged as of `cutoff`."""
        FinishedJobRegistry(queue=queue).cleanup()
        StartedJobRegistry(queue=queue).cleanup(cutoff, self._exc_handlers)
        FailedJobRegistry(queue=queue).cleanup()
        worker_registration.clean_worker_registry(queue)
        queue.intermediate_queue.cleanup(self, queue)

    def _tend_routing(self) -> None:
        # Every worker does this, so jobs routed to a worker that died never wait for a
        # Conclave worker (whose routing thread sweeps every TICK_S) to move them.
        self._routing.sweep(self._wait_s)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        # rq retries the dequeue itself; the state and heartbeat writes around it it does not.
        dequeue = partial(super().dequeue_job_and_maintain_ttl, timeout, max_idle_time)
        return self._waiter.call(dequeue)

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        if pipeline is not None:  # only queues commands; the pipeline's owner sends them
            super().heartbeat(timeout, pipeline)
            return
        self._waiter.call(partial(self._beat_or_register, timeout))

    def _beat_or_register(self, timeout: int | None) -> None:
        # After a long outage (or a Redis that lost its data) the registration has expired:
        # register again, or /readyz and `rq info` would not see a live worker.
        with self.connection.pipeline() as pipe:
            pipe.exists(self.key)
            pipe.sismember(self.redis_workers_keys, self.key)
            registered = all(pipe.execute())
        if not registered:
            log.info("worker %s registers again: Redis lost its registration", self.name)
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, mapping={**self.serialize(), "state": self.get_state()})
                worker_registration.register(self, pipe)
                pipe.sadd(Queue.redis_queues_keys, *self.queue_keys())
                pipe.execute()
        super().heartbeat(timeout)

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        if pipeline is not None:
            super().set_state(state, pipeline)
            return
        self._waiter.call(partial(super().set_state, state))

    def set_shutdown_requested_date(self) -> None:
        # Called from the SIGTERM handler: an error here would be raised inside the running job.
        try:
            super().set_shutdown_requested_date()  # type: ignore[no-untyped-call]
        except REDIS_DOWN as exc:
            self._waiter.failed(exc)

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[no-untyped-call]
        except REDIS_DOWN as exc:  # stopping during an outage: the registration expires
            log.warning("worker %s stops without unregistering (%s)", self.name, describe(exc))

    def unsubscribe(self) -> None:
        """rq sends UNSUBSCRIBE, then stops its pub/sub thread. The thread could read the reply
        first and go back to waiting, now for a subscription, for rq's whole 60 s poll; and
        since redis-py 8.2 `stop()` waits for the thread: a worker asked to stop then took a
        minute to exit (or was killed first, its pending snapshots lost). Here the thread's
        loop is ended first, so the reply is what wakes it to exit."""
        thread = self.pubsub_thread
        if thread is None:
            return
        log.info("worker %s unsubscribes from %s", self.name, self.pubsub_channel_name)
        _end_loop(thread)
        # A message that arrived meanwhile (its subscription's own confirmation, say) may have
        # woken the thread, which saw its loop ended and closed the connection under this
        # write: a closed connection holds no subscription.
        with contextlib.suppress(*REDIS_DOWN):
            self.pubsub.unsubscribe()
        thread.join(timeout=1)
        self.pubsub.close()

    def _pubsub_exception_handler(
        self, exc: Exception, pubsub: PubSub, pubsub_thread: PubSubWorkerThread
    ) -> None:
        # rq's own handler logs every retry; this one counts them (rq's reconnects by itself).
        if not isinstance(exc, REDIS_DOWN):
            super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)
            return
        self._waiter.failed(exc)
        time.sleep(2.0)


class ConclaveWorker(GranaryWorker):
    """Runs up to `max_active_jobs` jobs at once, each on a thread of its own, whose streams the
    Conclave (worker/conclave/) decodes together.

    Every job keeps what rq gives one: its execution in the started registry, its heartbeat,
    retries and failure callback. The loop takes another job only while fewer than
    `max_active_jobs` run and a sequence of the context is free (each holds any request up to
    n_ctx), so a job that cannot run yet waits in Redis, where any other worker may take it.
    A warm job is taken only when no other job runs.
    """

    # rq's default raises the timeout with SIGALRM, which only reaches the main thread.
    death_penalty_class = TimerDeathPenalty

    def __init__(
        self,
        redis: Redis,
        settings: WorkerSettings,
        routing_settings: RoutingSettings,
        waiter: RedisWaiter,
        free_sequences: Callable[[], int],
        held_documents: Callable[[], frozenset[str]],
        held_changed: threading.Event,
        forget: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        name = kwargs.pop("name", None) or uuid.uuid4().hex
        super().__init__(redis, settings, routing_settings, waiter, name=name, **kwargs)
        self._max_active = settings.max_active_jobs
        self._free_sequences = free_sequences
        self._held_documents = held_documents
        self._forget = forget
        self._active: dict[str, tuple[threading.Thread, str]] = {}
        self._beats: dict[str, Callable[[], None]] = {}  # per running execution
        self._changed = threading.Condition()
        self._shared = {q.name: q for q in self._ordered_queues}
        self._routes = routing_settings.enabled
        # Within each class, what was routed here goes first (shared/routing.py). Only the
        # dequeue reads the private lists: rq registers and reports the shared queues alone.
        self._private = [routing.private_queue(q, name) for q in ROUTED] if self._routes else []
        self._all_queues = self._listening_order()
        # Woken when memory's documents change and when a job starts or ends (room changes).
        self._advertise_now = held_changed
        # Its calls, every TICK_S, are what tells this worker of a stall even when it is idle.
        tick = partial(self._contact.timed, self._tick)
        self._ticker = _Periodic(tick, TICK_S, waiter, "routing", held_changed)
        self._ticking = False

    def _listening_order(self) -> list[Queue]:
        """interactive@me, interactive, batch@me, batch, warm (without routing: no private)."""
        order = []
        for name in QUEUES:
            private = routing.private_queue(name, self.name)
            if private in self._private:
                order.append(queue(self.connection, private))
            order.append(self._shared[name])
        return order

    def handle_payload(self, message: dict[str, Any]) -> None:
        """rq's commands, and granary's own (shared/worker_commands.py), on rq's pubsub thread."""
        payload = parse_payload(message)
        if payload.get("command") != worker_commands.FORGET:
            super().handle_payload(message)  # type: ignore[no-untyped-call]
            return
        self._forget()  # returns once the model thread has (and noted what memory holds)
        worker_commands.answer(self.connection, payload["reply"], self.name)
        log.info("worker %s dropped the prefixes its memory held idle", self.name)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            execution = self.prepare_execution(job)
        except REDIS_DOWN as exc:  # rq's registry cleanup re-queues a job it thinks started
            self._waiter.wait(exc)
            return
        beat = partial(self._contact.timed, partial(self.maintain_heartbeats, job, execution))
        thread = threading.Thread(
            target=self._perform,
            args=(job, queue, execution, beat),
            name=f"job-{job.id}",
            daemon=True,
        )
        with self._changed:
            self._active[execution.id] = (thread, queue.name)
            self._beats[execution.id] = beat
        thread.start()
        self._advertise_now.set()

    def _perform(self, job: Job, queue: Queue, execution: Any, beat: Callable[[], None]) -> None:
        try:
            with _Periodic(beat, self._heartbeat_ttl_s / 3, self._waiter, "heartbeat"):
                self.perform_job(job, queue, execution)
        except REDIS_DOWN as exc:
            # rq's bookkeeping around the job broke off. The job's own record (worker/tasks.py
            # waits out outages) is the truth; rq's registry cleanup re-queues a job it still
            # thinks is running, and running a job that already ended does nothing.
            self._waiter.wait(exc)
        finally:
            with self._changed:
                del self._active[execution.id]
                del self._beats[execution.id]
                idle = not self._active
                self._changed.notify_all()
            self._advertise_now.set()
            if idle:  # so a stop request now ends the worker at once
                self.set_state(WorkerStatus.IDLE)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """The next job once there is room; None once a stop is requested."""
        if not self._ticking:  # registered by now: start advertising
            self._ticking = True
            self._ticker.start()
        while not self._stop_requested:
            self._wait_for_room()
            if self._stop_requested:
                break
            warm_running = any(name == WARM for _, name in self._active.values())
            self._ordered_queues = [
                q for q in self._all_queues if q.name != WARM or not (warm_running or self._active)
            ]
            # rq's loop returns only with a job or when idle too long; a stop requested while
            # jobs run (the worker is busy, so rq only sets a flag, and no signal interrupts
            # the BLPOP) must end it too, as soon as the last one ends: so wait a second at a
            # time while any runs.
            wait = 1 if self._active else (timeout or 1)
            result = super().dequeue_job_and_maintain_ttl(wait, wait)
            if result is not None:
                return self._as_shared(*result)
        self._withdraw()
        return None

    def run_maintenance_tasks(self) -> None:
        self._beat_running()
        super().run_maintenance_tasks()

    def _beat_running(self) -> None:
        """Its own running jobs are alive, whatever their last heartbeat says: beaten right
        before its registry cleanup, they are never taken for abandoned by it (a heartbeat
        thread that fell behind, say). After an outage this is not enough: beats sent while
        Redis was away land late, and the cleanup itself may stall; `clean_registries` waits
        for unbroken contact then."""
        with self._changed:
            beats = list(self._beats.values())
        for beat in beats:
            self._waiter.call(beat)

    def _wait_for_room(self) -> None:
        with self._changed:
            while not self._stop_requested and not self._has_room():
                self._changed.wait(timeout=1.0)

    def _room(self) -> int:
        return max(0, min(self._max_active - len(self._active), self._free_sequences()))

    def _has_room(self) -> bool:
        return self._room() > 0

    def _tick(self) -> None:
        """Advertise what memory holds and the room left; hand back routed jobs that waited
        too long for any worker (the ticker thread, every TICK_S and on changes)."""
        if self._routes:
            held = self._held_documents()
            self._routing.advertise(self.name, held, self._room(), self._private)
        self._routing.sweep(self._wait_s)

    def _as_shared(self, job: Job, queue: Queue) -> tuple[Job, Queue]:
        """A job taken from a private list runs as its shared queue's: rq's started registry,
        retries and re-queues use the queue a job runs under."""
        shared = self._shared.get(job.origin)
        if shared is None or queue.name == shared.name:
            return job, queue
        try:
            member = routing.routed_member(queue.name, job.id)
            self.connection.zrem(keys.routed(), member)
        except REDIS_DOWN as exc:  # a sweep drops the entry once it finds the job gone
            self._waiter.failed(exc)
        return job, shared

    def _withdraw(self) -> None:
        """Stopping: nothing more is routed here, and what waits here goes back in front."""
        self._ticker.stop()  # first: a round running now would advertise room again
        if not self._routes:
            return
        self._routes = False
        moved = self._waiter.call(lambda: self._routing.withdraw(self.name, ROUTED))
        if moved:
            log.info("worker %s hands %d routed jobs back to the shared queues", self.name, moved)

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        # rq marks the worker idle around every dequeue; with jobs running it is busy.
        if state == WorkerStatus.IDLE and self._active:
            state = WorkerStatus.BUSY
        super().set_state(state, pipeline)

    def teardown(self) -> None:
        """A warm shutdown lets every running job finish first."""
        self._withdraw()
        for thread, _ in list(self._active.values()):
            thread.join()
        super().teardown()
