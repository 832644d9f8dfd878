"""A private redis-server that a test (or the soak) stops and starts again on the same port, or
freezes and thaws.

Append-only file on, as a deployment that keeps its jobs across a Redis restart runs it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

from shared.redis_server import answers, redis_server_binary


class RedisProcess:
    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
        ]  # fmt: skip
        log = (self.directory / "redis.log").open("ab")
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not answers(self.url, timeout_s=0.5):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: the server writes its append-only file out and exits, like a restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a frozen server would never act on SIGTERM
            self._proc.terminate()
            self._proc.wait(timeout=30)
        self._proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections stay open and nothing answers, as from a stalled host, a long
        fork or a partition that drops packets (the kernel still accepts new connections)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: the server goes on with whatever it was sent meanwhile."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()
