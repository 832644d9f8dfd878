"""A worker asked to stop (SIGTERM) stops: at once when idle, right after its running job."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from shared.redis_outage import RedisWaiter
from shared.settings import RoutingSettings, WorkerSettings
from tests.harness import HTTP, Stack
from tests.integration.test_stream_load import COUNTING, submit, wait_streaming
from worker.worker import GranaryWorker

log = logging.getLogger(__name__)

STOPS = 30


@contextmanager
def busy_thread() -> Iterator[None]:
    """A thread holding the GIL whenever it can, as a worker's model and routing threads do: a
    thread woken by I/O then often runs before the one that sent it (which is what let rq's
    pub/sub thread read its UNSUBSCRIBE reply first, and wait a minute for a subscription)."""
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_a_worker_leaves_its_channel_at_once_every_time(redis_url: str) -> None:
    # Before, about one stop in four (worker processes right after a job) took rq's whole 60 s
    # pub/sub poll; here, with a busy thread beside it, the old order hung within a few stops.
    client = redis.Redis.from_url(redis_url)
    took = []
    with busy_thread():
        for _ in range(STOPS):
            worker = GranaryWorker(
                client, WorkerSettings(), RoutingSettings(), RedisWaiter(client, log)
            )
            worker.subscribe()
            channel = worker.pubsub_channel_name
            while client.pubsub_numsub(channel)[0][1] < 1:  # Redis has the subscription
                time.sleep(0.01)
            started = time.monotonic()
            worker.unsubscribe()
            took.append(time.monotonic() - started)
            assert not worker.pubsub_thread.is_alive()
    client.close()
    assert max(took) < 2, took


def test_a_worker_stopped_mid_job_exits_right_after_it(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    job_id = submit(stack, prompt=COUNTING, max_tokens=60, temperature=0)
    wait_streaming(stack, job_id)
    stack.procs["worker-1"].terminate()
    stack.procs["worker-1"].wait(timeout=60)
    exited_at = time.time()

    job = HTTP.get(f"{stack.url}/v1/jobs/{job_id}").json()
    assert job["status"] == "finished", job
    assert job["usage"]["completion_tokens"] == 60
    # What follows its job (its teardown, pending snapshots, the model freed) takes little.
    assert exited_at - job["finished_at"] < 2, exited_at - job["finished_at"]
    assert "cold shut down" not in stack.log("worker-1")
