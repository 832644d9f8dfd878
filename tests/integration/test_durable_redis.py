"""Jobs queued on the private Redis `granary up` starts survive that Redis's crash and restart.

`ensure_redis` starts its private server only when nothing answers at the default URL, and on
this machine something may answer at 127.0.0.1:6379; so these tests point the default at a free
port, and `ensure_redis` takes the same path as under `granary up` on a machine without Redis.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import redis_server
from shared.redis_server import answers, ensure_redis, private_redis
from shared.settings import Settings
from tests.harness import HTTP, Stack, free_port

# appendfsync everysec: what was written more than a second before a crash is on disk.
FSYNC_WINDOW_S = 1.0


@pytest.fixture
def default_url(monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert not answers(url)
    monkeypatch.setattr(redis_server, "DEFAULT_REDIS_URL", url)
    return url


def _crash(url: str) -> None:
    """SIGKILL the server: no shutdown hook gets to flush anything."""
    client = redis.Redis.from_url(url)
    pid = int(client.info("server")["process_id"])
    client.close()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while answers(url):
        assert time.monotonic() < deadline, "redis-server outlived SIGKILL"
        time.sleep(0.05)


def _submit(api: str, prompt: str) -> str:
    response = HTTP.post(f"{api}/v1/jobs", json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def _wait_finished(api: str, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job: dict[str, Any] = HTTP.get(f"{api}/v1/jobs/{job_id}").json()
        if job["status"] in ("finished", "failed", "cancelled") or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def test_queued_jobs_survive_a_crash_of_the_private_redis(
    default_url: str, settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    run_dir = tmp_path / "data" / "run"
    with ensure_redis(default_url, run_dir) as url:
        assert url.startswith("unix://")
        settings = settings_factory(redis_url=url, api={"port": free_port()})
        before = Stack(settings, tmp_path)
        before.start_api()
        try:
            # No worker yet: the jobs stay queued.
            ids = [_submit(before.url, prompt) for prompt in ("One", "Two", "Three")]
            statuses = [HTTP.get(f"{before.url}/v1/jobs/{i}").json()["status"] for i in ids]
            assert statuses == ["queued"] * 3
        finally:
            before.stop()
        time.sleep(FSYNC_WINDOW_S + 1.0)
        _crash(url)

    with ensure_redis(default_url, run_dir) as url_again:
        assert url_again == url
        after = Stack(settings, tmp_path)
        after.start_api()
        try:
            after.start_worker()
            jobs = [_wait_finished(after.url, i) for i in ids]
        finally:
            after.stop()
    assert [job["status"] for job in jobs] == ["finished"] * 3, jobs
    assert all(job["result"]["text"] for job in jobs), jobs
    # The append-only file lives with the socket under the data directory.
    assert any(run_dir.glob("appendonly*")), sorted(p.name for p in run_dir.iterdir())


@pytest.mark.parametrize("persistent", [True, False])
def test_persistence_is_what_keeps_data_across_a_restart(tmp_path: Path, persistent: bool) -> None:
    """The control: the same stop and start keeps data only with the append-only file."""
    with private_redis(tmp_path, persistent=persistent) as url:
        redis.Redis.from_url(url).set("granary:test:kept", "yes")
    assert not answers(url)
    with private_redis(tmp_path, persistent=persistent) as url:
        kept = redis.Redis.from_url(url).get("granary:test:kept")
    assert kept == (b"yes" if persistent else None)
