"""Real processes for tests and benchmarks: an API and workers started like `granary up` does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.settings import Settings
from shared.worker_commands import FORGET, send_to_every_worker

REPO = Path(__file__).resolve().parent.parent
# The one HTTP client of every test request (httpx's may be shared between threads):
# `httpx.get` builds a client, TLS context included, for each call, many times the CPU of a
# request on a kept client, and tests polling a job every 50 ms took that from the core the
# worker under test computes on.
HTTP = httpx.Client(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a child process build exactly these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRANARY_")}
    for name, value in settings.model_dump(mode="json").items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                if subvalue is not None:
                    env[f"GRANARY_{name.upper()}__{sub.upper()}"] = str(subvalue)
        elif isinstance(value, list):
            env[f"GRANARY_{name.upper()}"] = ",".join(value)
        elif value is not None:
            env[f"GRANARY_{name.upper()}"] = str(value)
    return env


@dataclass
class Stack:
    """An API and workers as separate processes, like `granary up` runs them."""

    settings: Settings
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # on top of the settings' variables

    @property
    def url(self) -> str:
        return f"http://{self.settings.api.host}:{self.settings.api.port}"

    def _spawn(self, name: str, *command: str) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *command],
            env=settings_env(self.settings) | self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.procs[name] = proc
        return proc

    def start(self, workers: int = 1) -> None:
        """The API and `workers` workers (named worker-1, worker-2, ...). The API and the first
        worker start side by side, their imports overlapping on the cores; the others one at
        a time, as two model loads at once would fight over the same cores."""
        self._spawn("api", "api")
        for i in range(workers):
            self.start_worker(f"worker-{i + 1}")
        self._wait_listening()

    def start_api(self) -> None:
        self._spawn("api", "api")
        self._wait_listening()

    def _wait_listening(self) -> None:
        self._wait_for(lambda: _get_ok(f"{self.url}/healthz"), "the API to listen", ["api"])

    def start_worker(self, name: str = "worker") -> subprocess.Popen[bytes]:
        client = redis.Redis.from_url(self.settings.redis_url)
        # A new member, not a larger count: starting, the worker may clean a killed worker's
        # expired registration out of the set, and the count then stays where it was.
        before = client.smembers("rq:workers")
        proc = self._spawn(name, "worker")
        self._wait_for(
            lambda: bool(client.smembers("rq:workers") - before), f"{name} to register", [name]
        )
        return proc

    def _wait_for(self, check: Callable[[], bool], what: str, names: list[str]) -> None:
        """Wait for `check`; a process of `names` that exits first fails at once, with its log."""

        def done() -> bool:
            for name in names:
                if self.procs[name].poll() is not None:
                    tail = self.log(name)[-3000:]
                    raise RuntimeError(f"{name} exited while waiting for {what}:\n{tail}")
            return check()

        # A worker's start (model load, row check) took 3-51 s on a loaded 2-core host, and a
        # slow phase of the host makes everything up to 2.5 times slower; a process that exits
        # fails at once above, so a long wait only ever waits for one that is still starting.
        _wait_for(done, what, timeout_s=180)

    def forget(self) -> None:
        """Every worker writes its pending snapshots and drops what its memory holds idle, as
        `granary cache forget` asks: only the disk cache can help the next job."""
        with redis.Redis.from_url(self.settings.redis_url) as client:
            answered, silent = send_to_every_worker(client, FORGET, timeout_s=60)
        assert answered and not silent, f"workers that did not forget: {silent}"

    def start_warmer(self, *args: str, name: str = "warmer") -> subprocess.Popen[bytes]:
        return self._spawn(name, "warmer", *args)

    def stop_process(self, name: str) -> None:
        """SIGTERM and wait: a worker finishes its job and writes pending snapshots first."""
        self.procs[name].terminate()
        self.procs[name].wait(timeout=30)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


def _get_ok(url: str) -> bool:
    try:
        return HTTP.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
