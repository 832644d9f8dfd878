"""Job figures every worker adds to Redis, so the API can export them for Prometheus.

Workers run in other processes, often on other hosts, so prometheus-client's in-process
metrics cannot see them. Each finished job adds its token counts and its observations (queue
wait, time to first token, decode speed) to Redis hashes; histogram buckets are stored
per bucket and summed into cumulative Prometheus buckets when scraped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis import Redis

from shared import keys
from shared.schemas import ExtractionResult, SpeculationReport, Timings, Usage

# Upper bounds; the last bucket (+Inf) is implicit.
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "queue_wait_seconds": (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    "time_to_first_token_seconds": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    "decode_tokens_per_second": (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200),
}
TOKEN_COUNTERS = ("prompt_tokens", "cached_tokens", "completion_tokens")


@dataclass(frozen=True, slots=True)
class HistogramData:
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count), ending with +Inf
    sum: float
    count: int


def record_job(redis: Redis, usage: Usage, timings: Timings) -> None:
    observations = {
        "queue_wait_seconds": _seconds(timings.queued_ms),
        "time_to_first_token_seconds": _seconds(timings.ttft_ms),
        "decode_tokens_per_second": timings.decode_tokens_per_s,
    }
    with redis.pipeline(transaction=False) as pipe:
        for name in TOKEN_COUNTERS:
            pipe.hincrby(keys.metrics_counters(), name, getattr(usage, name))
        for name, value in observations.items():
            if value is not None:
                key = keys.metrics_histogram(name)
                pipe.hincrby(key, _bucket(name, value), 1)
                pipe.hincrbyfloat(key, "sum", value)
                pipe.hincrby(key, "count", 1)
        pipe.execute()


SPECULATION_COUNTERS = ("speculation_drafted_tokens", "speculation_accepted_tokens")
# The model's work, by what it read: prompt chunks or decode steps (a row is a token read).
# Counted by each worker's Conclave in whole milliseconds inside llama_decode, and rows.
MODEL_WORK = ("prompt", "decode")
MODEL_COUNTERS = tuple(f"model_{work}_{unit}" for work in MODEL_WORK for unit in ("ms", "rows"))


def record_speculation(redis: Redis, report: SpeculationReport) -> None:
    with redis.pipeline(transaction=False) as pipe:
        pipe.hincrby(keys.metrics_counters(), "speculation_drafted_tokens", report.drafted)
        pipe.hincrby(keys.metrics_counters(), "speculation_accepted_tokens", report.accepted)
        pipe.execute()


# Voted extraction answers, and those whose winner fewer than this share of samples agreed on:
# the answers worth a person's check.
VOTE_COUNTERS = {
    "voted_answers": "Extraction answers decided by a vote",
    "low_agreement_answers": "Voted answers with agreement below 0.6",
}
LOW_AGREEMENT = 0.6


def record_votes(redis: Redis, result: ExtractionResult) -> None:
    votes = [a.vote for a in result.answers.values() if a.vote is not None]
    if votes:
        low = sum(v.agreement < LOW_AGREEMENT for v in votes)
        with redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(keys.metrics_counters(), "voted_answers", len(votes))
            pipe.hincrby(keys.metrics_counters(), "low_agreement_answers", low)
            pipe.execute()


def read_counters(redis: Redis) -> dict[str, int]:
    raw: dict[bytes, bytes] = redis.hgetall(keys.metrics_counters())  # type: ignore[assignment]
    return {k.decode(): int(v) for k, v in raw.items()}


def read_histogram(redis: Redis, name: str) -> HistogramData:
    raw: dict[bytes, bytes] = redis.hgetall(keys.metrics_histogram(name))  # type: ignore[assignment]
    fields = {k.decode(): v for k, v in raw.items()}
    cumulative, buckets = 0, []
    for bound in (*HISTOGRAMS[name], math.inf):
        cumulative += int(fields.get(_label(bound), 0))
        buckets.append((bound, cumulative))
    return HistogramData(buckets, float(fields.get("sum", 0)), int(fields.get("count", 0)))


def _bucket(name: str, value: float) -> str:
    return _label(next((b for b in HISTOGRAMS[name] if value <= b), math.inf))


def _label(bound: float) -> str:
    return "le:+Inf" if math.isinf(bound) else f"le:{bound:g}"


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
