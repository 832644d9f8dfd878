"""`GET /metrics`: Prometheus text format, gathered from Redis at scrape time.

Workers are other processes (often on other hosts); their figures reach the API through Redis
(`shared.job_metrics`, `shared.prefix_cache.counters`), read here when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import get_args

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redis import Redis
from rq import Worker

from api.deps import State
from api.state import AppState
from shared import job_metrics, routing
from shared.prefix_cache import COUNTERS as CACHE_COUNTERS
from shared.prefix_cache import read_counters as read_cache_counters
from shared.queues import QUEUES, queue
from shared.schemas import WarmTrigger

router = APIRouter(tags=["metrics"])

JOB_STATUSES = ("finished", "failed", "cancelled")
RESULT_CACHE_COUNTERS = {
    "result_cache_hits": "Requests answered from a stored identical request's result",
    "result_cache_misses": "Greedy or seeded requests with no stored result",
    "result_cache_stored": "Finished results stored to answer identical requests",
}


class GranaryCollector(Collector):
    def __init__(self, state: AppState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        redis = self._state.redis
        yield from self._queues(redis)
        yield from self._jobs(redis)
        yield from self._cache(redis)

    def _queues(self, redis: Redis) -> Iterator[Metric]:
        depth = GaugeMetricFamily("granary_queue_depth", "Jobs waiting", labels=["queue"])
        # A worker runs several jobs at once: what all workers are running now, per queue.
        active = GaugeMetricFamily("granary_active_jobs", "Jobs running", labels=["queue"])
        for name in QUEUES:
            jobs = queue(redis, name)
            # Jobs routed to a worker holding their document wait in its private list.
            depth.add_metric([name], jobs.count + routing.waiting(redis, name))
            # Counted as they stand: rq's `count` would first run the registry's cleanup and
            # judge jobs abandoned by this process's clock, right after an outage too (when
            # every claim looks lapsed); only workers judge that (worker/worker.py).
            running = jobs.started_job_registry.get_job_count(cleanup=False)
            active.add_metric([name], running)
        yield depth
        yield active
        yield GaugeMetricFamily(
            "granary_workers", "Live workers", value=Worker.count(connection=redis)
        )

    def _jobs(self, redis: Redis) -> Iterator[Metric]:
        counters = job_metrics.read_counters(redis)
        yield CounterMetricFamily(
            "granary_jobs_submitted", "Jobs accepted", value=counters.get("jobs_submitted", 0)
        )
        ended = CounterMetricFamily("granary_jobs", "Jobs by final status", labels=["status"])
        for status in JOB_STATUSES:
            ended.add_metric([status], counters.get(f"jobs_{status}", 0))
        yield ended
        runs = CounterMetricFamily("granary_warm_runs", "Warm runs started", labels=["trigger"])
        for trigger in get_args(WarmTrigger):
            runs.add_metric([trigger], counters.get(f"warm_runs_{trigger}", 0))
        yield runs
        yield CounterMetricFamily(
            "granary_warm_tokens",
            "Prefix tokens computed by warm jobs",
            value=counters.get("warm_tokens", 0),
        )
        for name in job_metrics.SPECULATION_COUNTERS:
            yield CounterMetricFamily(
                f"granary_{name}", name.replace("_", " "), value=counters.get(name, 0)
            )
        for name, text in (RESULT_CACHE_COUNTERS | job_metrics.VOTE_COUNTERS).items():
            yield CounterMetricFamily(f"granary_{name}", text, value=counters.get(name, 0))
        for name in job_metrics.TOKEN_COUNTERS:
            yield CounterMetricFamily(
                f"granary_{name}", f"{name.replace('_', ' ')}", value=counters.get(name, 0)
            )
        yield from _model_work(counters)
        for name in job_metrics.HISTOGRAMS:
            data = job_metrics.read_histogram(redis, name)
            buckets = [("+Inf" if b == float("inf") else f"{b:g}", c) for b, c in data.buckets]
            yield HistogramMetricFamily(
                f"granary_{name}", name.replace("_", " "), buckets=buckets, sum_value=data.sum
            )

    def _cache(self, redis: Redis) -> Iterator[Metric]:
        cache = self._state.cache
        if cache is None:
            return
        counters = read_cache_counters(redis, cache.fingerprint)
        for name, text in CACHE_COUNTERS.items():
            value: float = counters.get(name, 0)
            if name.endswith("_ms"):  # kept as whole milliseconds, exported as Prometheus does
                name, value = f"{name.removesuffix('_ms')}_seconds", value / 1000
            yield CounterMetricFamily(f"granary_cache_{name}", text, value=value)
        stats = cache.stats()
        yield GaugeMetricFamily("granary_cache_entries", "Cache entries", value=stats.entries)
        yield GaugeMetricFamily("granary_cache_bytes", "Cache bytes on disk", value=stats.bytes)
        yield GaugeMetricFamily("granary_cache_max_bytes", "Cache budget", value=stats.max_bytes)


@router.get("/metrics")
def metrics(state: State) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GranaryCollector(state))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _model_work(counters: dict[str, int]) -> Iterator[Metric]:
    """Every worker's model work: seconds inside llama_decode and rows read, by what was read.
    Their rate over the wall time is how busy the workers' models are."""
    seconds = CounterMetricFamily(
        "granary_model_seconds", "Seconds the models spent reading", labels=["work"]
    )
    rows = CounterMetricFamily(
        "granary_model_rows", "Rows (tokens) the models read", labels=["work"]
    )
    for work in job_metrics.MODEL_WORK:
        seconds.add_metric([work], counters.get(f"model_{work}_ms", 0) / 1000)
        rows.add_metric([work], counters.get(f"model_{work}_rows", 0))
    yield seconds
    yield rows
