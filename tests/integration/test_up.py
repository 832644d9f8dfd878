"""`granary up` runs the whole stack in the foreground and stops it all on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import redis
from rq import Worker

from shared.redis_server import answers, private_redis
from shared.settings import Settings
from tests.harness import HTTP, REPO, free_port, settings_env


def test_private_redis_starts_answers_and_stops(tmp_path: Path) -> None:
    with private_redis(tmp_path, persistent=False) as url:
        assert url.startswith("unix://")
        assert answers(url)
    assert not answers(url)


def test_up_serves_a_job_and_stops_everything(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = settings_factory(api={"port": free_port()})
    log = (tmp_path / "up.log").open("w+b")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--workers", "1"],
        env=settings_env(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    url = f"http://{settings.api.host}:{settings.api.port}"
    try:
        deadline = time.monotonic() + 60
        while b"granary is up" not in (tmp_path / "up.log").read_bytes():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "granary up never said it was up"
            time.sleep(0.2)
        assert url.encode() in (tmp_path / "up.log").read_bytes()
        while HTTP.get(f"{url}/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        job = HTTP.post(f"{url}/v1/jobs", json={"prompt": "Hi", "max_tokens": 3}).json()
        while HTTP.get(f"{url}/v1/jobs/{job['id']}").json()["status"] != "finished":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    # Workers deregister on a clean stop; the API no longer listens.
    assert Worker.count(connection=redis.Redis.from_url(settings.redis_url)) == 0
    try:
        HTTP.get(f"{url}/healthz", timeout=1)
        raise AssertionError("the API still answers after granary up stopped")
    except httpx.ConnectError:
        pass
