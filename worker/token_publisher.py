"""Publishes a job's events (tokens, answers) from a thread, so decoding never waits on Redis.

Events produced while a publish is in flight, or within `interval_s` of the last one, go out
together in one script call and one pub/sub message: on a 2-core machine every wake-up of Redis,
the API and the client takes CPU from decoding. Events are numbered in the order they are put,
from `first_index` (what earlier attempts of the job published, worker/resume.py); the script
skips an index already published, so none is published twice. While Redis is down, events
wait here and go out once it answers again (publishing again what may have gone out is safe),
so listeners who resume miss none.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from shared.job_store import JobStore
from shared.redis_outage import REDIS_DOWN, RedisWaiter
from shared.schemas import Answer, AnswerEvent, TokenEvent

log = logging.getLogger(__name__)


class TokenPublisher:
    def __init__(
        self,
        store: JobStore,
        job_id: str,
        interval_s: float,
        waiter: RedisWaiter,
        first_index: int = 0,
    ) -> None:
        self._store = store
        self._waiter = waiter
        self._job_id = job_id
        self._interval_s = interval_s
        self._pending: list[TokenEvent | AnswerEvent] = []
        self._next = first_index
        self._closed = False
        self._wake = threading.Condition()
        self._ending = threading.Event()
        self.cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"publish-{job_id}", daemon=True)
        self._thread.start()

    def token(self, token: int | None, text: str, question: str | None = None) -> bool:
        """Queue a token's text; returns True once the job is known to be cancelled."""
        return self._put(TokenEvent(index=self._next, text=text, question=question, token=token))

    def answer(self, question: str, answer: Answer) -> bool:
        return self._put(AnswerEvent(index=self._next, question=question, answer=answer))

    def _put(self, event: TokenEvent | AnswerEvent) -> bool:
        with self._wake:
            self._pending.append(event)
            self._next += 1
            self._wake.notify()
        return self.cancelled.is_set()

    def __enter__(self) -> TokenPublisher:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        """Publish everything still pending, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._ending.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closed)
                batch, self._pending = self._pending, []
                closed = self._closed
            if not batch:
                return  # closed, and everything is out
            if not self._publish(batch):
                with self._wake:
                    self._pending[:0] = batch  # first in line once Redis answers
            elif not closed:
                # Until the interval is over or the job ends: the job's end waits for this
                # thread, and a sleep cost every job up to the whole interval (50 ms of a
                # question's ~450 ms). Not on `_wake`, which every token would wake.
                self._ending.wait(self._interval_s)

    def _publish(self, batch: list[TokenEvent | AnswerEvent]) -> bool:
        """Publish the batch; False when Redis was down (after waiting until it answers)."""
        try:
            if self._store.emit(self._job_id, batch):
                self.cancelled.set()
        except REDIS_DOWN as exc:
            self._waiter.wait(exc)
            return False
        except Exception:  # live tokens are lost; the job's result is still recorded
            log.warning(
                "publishing %d tokens of job %s failed", len(batch), self._job_id, exc_info=True
            )
        return True
