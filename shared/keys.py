"""Every Redis key and channel name granary uses, in one place.

rq keeps its own keys under `rq:`; granary's live under `granary:`.
"""

from __future__ import annotations

PREFIX = "granary"


def job(job_id: str) -> str:
    """Hash holding the job record (status, request, result, usage, timings)."""
    return f"{PREFIX}:job:{job_id}"


def job_events(job_id: str) -> str:
    """Stream of every event of a job, so late and reconnecting listeners miss nothing."""
    return f"{PREFIX}:job:{job_id}:events"


def job_channel(job_id: str) -> str:
    """Pub/sub channel carrying the same events live (the API listens to all of them with one
    pattern subscription: `job_channel("*")`)."""
    return f"{PREFIX}:job:{job_id}:live"


def job_cancel(job_id: str) -> str:
    """Flag a running job's worker polls between tokens."""
    return f"{PREFIX}:job:{job_id}:cancel"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idempotency:{key}"


def cache_counters(fingerprint: str) -> str:
    """Hash of prefix-cache counters summed over every worker of one model fingerprint."""
    return f"{PREFIX}:cache:{fingerprint}:counters"


def result_entry(digest: str) -> str:
    """A finished result, stored to answer identical requests (shared/result_cache.py)."""
    return f"{PREFIX}:result:{digest}"


def result_index() -> str:
    """Sorted set: result digest -> when it was last recorded or used (the size cap's order)."""
    return f"{PREFIX}:results"


def metrics_counters() -> str:
    """Hash of job counters summed over every worker (tokens; jobs by final status)."""
    return f"{PREFIX}:metrics:counters"


def metrics_histogram(name: str) -> str:
    """Hash of one histogram's bucket counts, sum and count, over every worker."""
    return f"{PREFIX}:metrics:histogram:{name}"


def warm_runs() -> str:
    """List of recent warm run ids, newest first (capped)."""
    return f"{PREFIX}:warm:runs"


def warm_run(run_id: str) -> str:
    """Hash describing one warm run: trigger, start time, its jobs."""
    return f"{PREFIX}:warm:run:{run_id}"


def warm_pending(prefix_id: str) -> str:
    """The warm job already queued or running for a prefix: later requests for it join it."""
    return f"{PREFIX}:warm:pending:{prefix_id}"


def warmer_last_fire() -> str:
    """The scheduled time of the warmer's last run, so a restarted warmer knows what it missed."""
    return f"{PREFIX}:warmer:last-fire"


def prefix_uses() -> str:
    """Sorted set: learned prefix id -> times requests used it."""
    return f"{PREFIX}:prefixes:uses"


def prefix_usage(prefix_id: str) -> str:
    """Hash for one learned prefix: how to rebuild it, its namespace, hits and misses."""
    return f"{PREFIX}:prefixes:{prefix_id}"


def batch(batch_id: str) -> str:
    """Hash describing one batch: owner, creation time, item count."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_items(batch_id: str) -> str:
    """List of the batch's items in order, each "custom_id job_id" as JSON."""
    return f"{PREFIX}:batch:{batch_id}:items"


def holder(prefix_id: str) -> str:
    """The worker whose memory holds a document prefix now (expires unless refreshed)."""
    return f"{PREFIX}:holder:{prefix_id}"


def room(worker: str) -> str:
    """How many more jobs a worker can take now (expires unless refreshed): routing sends it
    at most that many, each taking one."""
    return f"{PREFIX}:room:{worker}"


def routing_workers() -> str:
    """Sorted set: worker name -> when its advertisement expires (Redis time), so routing
    knows how many workers are live."""
    return f"{PREFIX}:routing:workers"


def command_replies(command_id: str) -> str:
    """List: the names of the workers that carried out one command sent to them all."""
    return f"{PREFIX}:command:{command_id}:replies"


def routed() -> str:
    """Sorted set: "<private queue> <job id>" -> when the job was routed (Redis time), so any
    worker can hand a job its worker did not take back to the shared queue."""
    return f"{PREFIX}:routing:routed"
