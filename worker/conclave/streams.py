"""What a job hands the Conclave, and what it gets back: a stream request and its handle.

A job thread builds a `StreamRequest` (its prompt's tokens and how to decode after them),
submits it and reads the handle's events: `Started` once memory holds the prompt's prefix,
then `Ended` (or `Failed`). Each sampled token goes to the handle's `on_token`, called on the
model thread between steps: waking a job thread per token would take a core from llama.cpp's
threads mid-step, which stalls them all. The job thread never touches the model's memory.
Cancelling (a stop string, a client's cancel, a timeout) only raises a flag the model thread
reads before its next step.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from worker.conclave.drafts import Mode
from worker.restore_cost import Choice
from worker.sampling import Sampling

# Prefill order between priority classes: the rq queue a job came from (shared/queues.py).
INTERACTIVE, BATCH, WARM = 0, 1, 2

EndReason = Literal["stop", "length", "prefilled", "cancelled"]


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One sequence's work: hold `tokens[:prefill_end]` in memory, then decode `max_new`."""

    tokens: list[int]
    # Extra chunk ends (worker/prompt_breaks.py); see worker/chunk_ends.py.
    breaks: tuple[int, ...]
    namespace: str | None
    priority: int
    # 0: prefill only (a warm job, an extraction's shared prefix).
    max_new: int
    sampling: Sampling = field(default_factory=Sampling)
    # Where prefill stops; None: the last-but-one token (the last is decoded with the first
    # sample). A prefill-only stream stops at its declared prefix's end.
    end: int | None = None
    # Keep the sequence reserved after prefill until the handle closes: an extraction's
    # questions fork from it.
    hold: bool = False
    # The document prefix the prompt starts with: (its prefix id, its tokens). Once memory
    # holds all of it, the worker advertises it, so routing sends its next question here.
    document: tuple[str, int] | None = None
    # The breaks hold a declared shared prefix's end (a document), not the prompt's own
    # (worker/chunk_ends.py snapshot_points).
    declared: bool = True
    # Draft rows from the stream's own tokens (worker/conclave/drafts.py).
    speculation: Mode = "off"

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a stream needs at least one token")
        if self.max_new < 0:
            raise ValueError("max_new cannot be negative")

    @property
    def prefill_end(self) -> int:
        return len(self.tokens) - 1 if self.end is None else self.end

    @property
    def cells(self) -> int:
        """KV cells the stream may fill in its sequence: its prompt and every token it may
        decode."""
        if self.max_new == 0:
            return self.prefill_end
        return len(self.tokens) + self.max_new


@dataclass(frozen=True, slots=True)
class Started:
    cached_tokens: int  # restored from memory or disk instead of prefilled
    restore_ms: float | None  # time spent reading a prefix from disk, if one was read
    prefill_started: float  # perf_counter when prefill of the rest began
    choice: Choice | None = None  # a prefix found on disk: whether it was restored, and why


@dataclass(frozen=True, slots=True)
class Token:
    token: int
    at: float  # perf_counter when it was sampled


@dataclass(frozen=True, slots=True)
class Ended:
    reason: EndReason
    position: int = 0  # cells the sequence held when it ended
    replays: int = 0  # near-tie replays the stream needed (exact batching)
    # A token was sampled from logits computed beside other rows and not decided again as a
    # lone run would (a sampled row, or any row without exact batching): the output may
    # depend on what ran beside it, so it is not stored as the request's result.
    drifted: bool = False
    # perf_counter when the end was decided: for a stream whose first sample ended it (no
    # token), the time to that decision is its time to first token.
    at: float = field(default_factory=time.perf_counter)
    # Draft tokens the stream's passes carried, and how many of them it wrote.
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


Event = Started | Token | Ended | Failed


class StreamHandle:
    """The job thread's side of a stream. Closing it (always: `with`) ends the stream."""

    def __init__(
        self,
        request: StreamRequest,
        wake: threading.Event,
        on_token: Callable[[Token], bool],
        events: queue.SimpleQueue[tuple[StreamHandle, Event]] | None = None,
        tag: int = 0,
    ) -> None:
        self.request = request
        self._on_token = on_token
        # Streams of one job (an extraction's questions) may share one queue: `tag` says whose.
        self.tag = tag
        self._events: queue.SimpleQueue[tuple[StreamHandle, Event]] = events or queue.SimpleQueue()
        self._wake = wake
        self.cancelled = threading.Event()
        self.closed = threading.Event()

    def __enter__(self) -> StreamHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def put(self, event: Event) -> None:
        """Model thread: deliver an event."""
        self._events.put((self, event))

    def token(self, token: Token) -> None:
        """Model thread: hand a sampled token on; the callback may cancel the stream."""
        try:
            stop = self._on_token(token)
        except Exception as exc:  # the job fails, not the model thread
            self.put(Failed(exc))
            stop = True
        if stop:
            self.cancelled.set()

    def next(self, timeout: float | None = None) -> Event | None:
        """Job thread: the next event of this handle's queue (only its own unless shared);
        None if `timeout` seconds passed first."""
        try:
            return self._events.get(timeout=timeout)[1]
        except queue.Empty:
            return None

    def cancel(self) -> None:
        """Stop decoding after the current step; the stream ends with `cancelled`."""
        self.cancelled.set()
        self._wake.set()

    def close(self) -> None:
        """Give the sequence back (a held prefix, or a stream the job stops reading)."""
        self.cancelled.set()
        self.closed.set()
        self._wake.set()


class StreamFailed(RuntimeError):
    """The model thread could not serve a stream (its error is the cause)."""


def expect(event: Event | None) -> Event | None:
    """Raise what the model thread reported instead of an event."""
    if isinstance(event, Failed):
        raise StreamFailed(str(event.error)) from event.error
    return event


def wait_started(handle: StreamHandle) -> Started:
    event = expect(handle.next())
    assert isinstance(event, Started), event
    return event


def wait_ended(handle: StreamHandle) -> Ended:
    event = expect(handle.next())
    assert isinstance(event, Ended), event
    return event
