"""A private redis-server that a test (or the soak) stops and starts again on the same port.

Append-only file on, as a deployment that keeps its jobs across a Redis restart runs it.
"""

from __future__ import annotations

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
            self._proc.terminate()
            self._proc.wait(timeout=30)
        self._proc = None

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()
