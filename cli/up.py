"""`granary up`: the whole stack in the foreground — Redis if needed, API, workers, warmer.

Each part is its own process (as in production, where they run as separate services); this
supervisor starts them, restarts one that dies, and stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from shared.models import resolve_model
from shared.redis_server import ensure_redis
from shared.settings import Settings

log = logging.getLogger(__name__)

RESTART_DELAY_S = 1.0


@dataclass
class _Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = field(default=None)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _children(
    settings: Settings, config: Path | None, redis_url: str, workers: int
) -> list[_Child]:
    base = [sys.executable, "-m", "cli.main"]
    if config is not None:
        base += ["--config", str(config)]
    env = {**os.environ, "GRANARY_REDIS_URL": redis_url}
    worker_env = dict(env)
    if settings.n_threads is None:
        # llama.cpp threads spin while they wait: workers sharing cores slow each other down
        # many times over, so split the cores between them.
        worker_env["GRANARY_N_THREADS"] = str(max(1, settings.threads // workers))
    kids = [_Child("api", [*base, "api"], env)]
    kids += [_Child(f"worker-{i + 1}", [*base, "worker"], worker_env) for i in range(workers)]
    kids.append(_Child("warmer", [*base, "warmer"], env))
    return kids


def _wait_until_listening(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def run_stack(settings: Settings, config: Path | None, workers: int) -> int:
    stopping = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    # A missing model is one clear message here, not every child failing and restarting.
    resolve_model(settings.model, settings.data_dir)
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with ensure_redis(settings.redis_url, settings.data_dir / "run") as redis_url:
        kids = _children(settings, config, redis_url, workers)
        for kid in kids:
            kid.start()
        api_url = f"http://{settings.api.host}:{settings.api.port}"
        if _wait_until_listening(api_url, timeout_s=60):
            print(f"granary is up: API listening on {api_url} (Redis {redis_url})", flush=True)
        while not stopping:
            time.sleep(0.5)
            for kid in kids:
                if not stopping and kid.proc is not None and kid.proc.poll() is not None:
                    log.warning("%s exited with %s; restarting", kid.name, kid.proc.returncode)
                    time.sleep(RESTART_DELAY_S)
                    kid.start()
        for kid in kids:
            kid.stop()
        for kid in kids:
            kid.wait(timeout_s=10)
    return 0
