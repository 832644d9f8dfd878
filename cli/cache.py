"""`granary cache stats|ls|verify|prune|clear|forget`: look after the prefix cache by hand."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import orjson

from shared.prefix_cache import PrefixCache, cache_report, open_cache
from shared.redis_server import answers, connect
from shared.settings import Settings
from shared.worker_commands import FORGET, send_to_every_worker


def run_cache_command(action: str, settings: Settings) -> int:
    if action == "forget":
        return _forget(settings)
    cache = open_cache(settings)
    if action == "stats":
        redis = connect(settings.redis_url) if answers(settings.redis_url) else None
        _print(cache_report(settings, redis, cache).model_dump())
    elif action == "ls":
        _list(cache)
    elif action == "verify":
        _print(asdict(cache.verify()))
    elif action == "prune":
        _print({"bytes_freed": cache.prune()})
    elif action == "clear":
        _print({"entries_removed": cache.clear()})
    return 0


def _forget(settings: Settings) -> int:
    """Every live worker drops what its memory holds idle; the disk cache keeps it."""
    answered, silent = send_to_every_worker(connect(settings.redis_url), FORGET)
    _print({"workers_forgot": answered, "workers_not_answering": silent})
    return 1 if silent else 0


def _list(cache: PrefixCache) -> None:
    print(f"{'tokens':>8} {'bytes':>12} {'hits':>5}  last used            key")
    for entry in cache.entries():
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used_s))
        print(f"{entry.n_tokens:>8} {entry.bytes:>12} {entry.hits:>5}  {used}  {entry.key}")


def _print(data: object) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")
