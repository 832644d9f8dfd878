"""The prefix cache on slow storage: restore or recompute, and saves beside decoding streams.

The cache directory is a file system on a loop device whose reads a blkio cgroup throttles to
a disk's rate; the bench process joins the cgroup, so the API and workers it starts read that
directory at the throttled rate, and every other file (the model, Python) at the host's.
Root only (a loop device, a mount, a cgroup); elsewhere the section says it was not measured.

1. Restore or recompute: one worker per storage rate; for each prompt length, a new document
   prompt is run cold (nothing stored: its snapshot is written), the worker forgets its
   memory and the cache's files leave the page cache, then the same prompt runs again. Its
   time to first token with the cache against the cold one, per job, and what the worker chose
   and expected (`Timings.restore_choice`, the two estimates). The worker's own account of the
   time restores saved (`/v1/cache`: `prefill_saved_ms` less `restore_ms`) is set against the
   bench's: the cold runs' TTFT less the cached runs', over the jobs that restored.
2. Saves beside decoding: eight clients, two new ~600-token documents each, 64 tokens
   written, with the cache on the throttled directory (every prompt's snapshot is saved while
   the others decode) and with the cache off, in alternating rounds; a ratio per round of the
   streams' mean decode tok/s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.paired import ForeignCpu, per_round, ratio_summary, shares_text
from bench.prefix_cache import Run, document, drop_from_page_cache, timed_job
from shared.prefix_cache import open_cache
from shared.schemas import CacheReport
from shared.settings import Settings
from tests.harness import Stack

# Sequential reads: a 7,200 rpm disk's; a network volume's (a small cloud disk's baseline, NFS
# over a shared 100 Mbit/s link); and a disk so busy that prefilling again is cheaper.
STORAGE = {
    "HDD-like, 100 MB/s": 100_000_000,
    "network disk, 10 MB/s": 10_000_000,
    "congested, 1 MB/s": 1_000_000,
}
LENGTHS = {"~300 tokens": 9, "~1,000 tokens": 30, "~3,000 tokens": 90}  # ledger lines
IMAGE_BYTES = 2 * 2**30
SAVES_STORAGE = "HDD-like, 100 MB/s"
# Where the cached runs are recomputed, so cache / cold should be 1: the same prompt is run cold
# a second time there, and that ratio shows what one job's TTFT varies by on this host.
CONTROL_STORAGE = "congested, 1 MB/s"
CLIENTS = 8
PER_CLIENT = 2
SAVES_LINES = 18  # ~600 tokens
SAVES_TOKENS = 64
TTFT_TARGET = 1.05
DECODE_TARGET = 0.95
ACCOUNT_TARGET = 0.10


@dataclass(frozen=True, slots=True)
class Pair:
    storage: str
    length: str
    cold: Run
    cached: Run
    counted: dict[str, int]  # the worker's counters over the cached run
    cold_again: Run | None  # the control: the same prompt cold once more (CONTROL_STORAGE)


class Throttled:
    """A file system mounted at `mount` whose reads, by the processes of `cgroup`, run at most
    at the rate last `limit`ed."""

    def __init__(self, mount: Path, device: str, cgroup: Path) -> None:
        self.mount, self._device, self._cgroup = mount, device, cgroup

    def limit(self, bytes_per_s: int) -> None:
        (self._cgroup / "blkio.throttle.read_bps_device").write_text(
            f"{self._device} {bytes_per_s}\n"
        )


def unavailable() -> str | None:
    """Why throttled storage cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (a loop device, a mount and a blkio cgroup)"
    if not Path("/sys/fs/cgroup/blkio").is_dir():
        return "no cgroup v1 blkio controller on this host"
    if shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        return "needs losetup and mkfs.ext4"
    return None


@contextmanager
def throttled_storage(workdir: Path) -> Iterator[Throttled]:
    image, mount = workdir / "disk.img", workdir / "mnt"
    cgroup = Path(f"/sys/fs/cgroup/blkio/granary-bench-{os.getpid()}")
    with image.open("wb") as f:
        f.truncate(IMAGE_BYTES)
    loop = _run("losetup", "--find", "--show", str(image))
    try:
        _run("mkfs.ext4", "-q", loop)
        mount.mkdir()
        _run("mount", loop, str(mount))
        try:
            cgroup.mkdir()
            (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
            try:
                rdev = os.stat(loop).st_rdev
                yield Throttled(mount, f"{os.major(rdev)}:{os.minor(rdev)}", cgroup)
            finally:
                Path("/sys/fs/cgroup/blkio/cgroup.procs").write_text(f"{os.getpid()}\n")
                cgroup.rmdir()
        finally:
            _run("umount", str(mount))
    finally:
        _run("losetup", "--detach", loop)


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def counters(stack: Stack) -> dict[str, int]:
    report = httpx.get(f"{stack.url}/v1/cache", timeout=30).json()
    return {k: v for k, v in report.items() if type(v) is int}  # counters, not `enabled`


def restore_or_recompute(
    settings: Settings, log_dir: Path, disk: Throttled, rounds: int
) -> list[Pair]:
    pairs: list[Pair] = []
    for storage, rate in STORAGE.items():
        disk.limit(rate)
        cache_dir = disk.mount / "kv"
        shutil.rmtree(cache_dir, ignore_errors=True)
        local = settings.model_copy(
            update={"cache": settings.cache.model_copy(update={"dir": cache_dir})}
        )
        # A worker per rate: it measures the directory's uncached rate when it starts.
        stack = Stack(local, log_dir)
        stack.start()
        try:
            for r in range(rounds):
                for length, lines in LENGTHS.items():
                    prompt = document(lines, seed=7919 * r + 31 * lines + len(pairs))
                    cold = timed_job(stack, prompt)
                    stack.forget()  # writes the snapshot, drops memory
                    drop_from_page_cache(cache_dir)
                    before = counters(stack)
                    cached = timed_job(stack, prompt)
                    after = counters(stack)
                    counted = {k: after[k] - before.get(k, 0) for k in after}
                    again = None
                    if storage == CONTROL_STORAGE:
                        stack.forget()  # the cached run's own save lands before the clear
                        open_cache(local).clear()
                        stack.forget()
                        again = timed_job(stack, prompt)
                    pairs.append(Pair(storage, length, cold, cached, counted, again))
        finally:
            stack.stop()
    return pairs


@dataclass(frozen=True, slots=True)
class DecodeRound:
    mean_tok_s: float
    counted: dict[str, int]  # the worker's counters over the round (cache on only)
    foreign: float


def decode_round(settings: Settings, log_dir: Path, cache_on: bool, seed: int) -> DecodeRound:
    stack = Stack(settings, log_dir)
    stack.start()
    try:
        prompts = [document(SAVES_LINES, seed=seed + i) for i in range(CLIENTS * PER_CLIENT)]

        def client(i: int) -> list[Run]:
            return [
                timed_job(stack, {"prompt": p, "max_tokens": SAVES_TOKENS})
                for p in prompts[i * PER_CLIENT : (i + 1) * PER_CLIENT]
            ]

        before = counters(stack) if cache_on else {}
        with ForeignCpu() as foreign, ThreadPoolExecutor(CLIENTS) as pool:
            runs = [run for runs in pool.map(client, range(CLIENTS)) for run in runs]
        if cache_on:
            stack.forget()  # the saves still waiting are written (or were dropped)
        after = counters(stack) if cache_on else {}
        rates = [run.job["timings"]["decode_tokens_per_s"] for run in runs]
    finally:
        stack.stop()
    counted = {k: v - before.get(k, 0) for k, v in after.items()}
    return DecodeRound(statistics.fmean(rates), counted, foreign.share)


def saves_beside_decoding(
    settings: Settings, log_dir: Path, disk: Throttled, rounds: int
) -> list[tuple[DecodeRound, DecodeRound]]:
    disk.limit(STORAGE[SAVES_STORAGE])
    cache_dir = disk.mount / "saves-kv"
    on = settings.model_copy(update={"cache": settings.cache.model_copy(update={"dir": cache_dir})})
    off = settings.model_copy(
        update={"cache": settings.cache.model_copy(update={"enabled": False})}
    )
    out = []
    for r in range(rounds):
        shutil.rmtree(cache_dir, ignore_errors=True)  # every prompt new to the cache too
        seed = 1000 * (r + 1)
        with_cache = decode_round(on, log_dir, True, seed)
        without = decode_round(off, log_dir, False, seed)
        out.append((with_cache, without))
    return out


def section(settings: Settings, log_dir: Path, rounds: int, decode_rounds: int) -> str:
    reason = unavailable()
    if reason is not None:
        return f"{HEADER}\nNot measured on this host: {reason}.\n"
    with tempfile.TemporaryDirectory(dir=log_dir) as tmp, throttled_storage(Path(tmp)) as disk:
        pairs = restore_or_recompute(settings, log_dir, disk, rounds)
        decoding = saves_beside_decoding(settings, log_dir, disk, decode_rounds)
    return HEADER + _pairs_table(pairs) + _accounting(pairs) + _decoding_text(decoding)


def _pairs_table(pairs: list[Pair]) -> str:
    rows = []
    for storage in STORAGE:
        for length in LENGTHS:
            group = [p for p in pairs if (p.storage, p.length) == (storage, length)]
            ratios = [p.cached.client_ttft_s / p.cold.client_ttft_s for p in group]
            timings = [p.cached.job["timings"] for p in group]
            choices = sorted({t["restore_choice"] or "none" for t in timings})
            same = all(
                p.cached.job["result"]["text"] == p.cold.job["result"]["text"] for p in group
            )
            rows.append(
                f"| {storage} | {length} ({group[0].cold.job['usage']['prompt_tokens']}) | "
                f"{_median_ms([p.cold.client_ttft_s for p in group])} | "
                f"{_median_ms([p.cached.client_ttft_s for p in group])} | "
                f"{ratio_summary(ratios)} | {', '.join(choices)} | "
                f"{_median_of(timings, 'restore_estimate_ms')} | "
                f"{_median_of(timings, 'recompute_estimate_ms')} | "
                f"{_median_of(timings, 'restore_ms')} | {'yes' if same else 'NO'} |"
            )
    worst = max(p.cached.client_ttft_s / p.cold.client_ttft_s for p in pairs)
    verdict = "met" if worst <= TTFT_TARGET else "MISSED"
    control = ", ".join(
        f"{p.length} {p.cold_again.client_ttft_s / p.cold.client_ttft_s:.2f}×"
        for p in pairs
        if p.cold_again is not None
    )
    return (
        TABLE_HEADER
        + "\n".join(rows)
        + f"\n\nThe slowest job with the cache took **{worst:.2f}×** its cold time to first "
        f"token (target ≤ {TTFT_TARGET:.2f}×: {verdict}). The control, each {CONTROL_STORAGE} "
        f"prompt run cold a second time (its stored state deleted) against its first cold run: "
        f"{control}.\n"
    )


def _median_ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.0f}"


def _median_of(timings: list[dict[str, Any]], name: str) -> str:
    values = [t[name] for t in timings if t.get(name) is not None]
    return f"{statistics.median(values):.0f}" if values else "–"


def _accounting(pairs: list[Pair]) -> str:
    restored = [p for p in pairs if p.cached.job["timings"]["restore_choice"] == "restore"]
    if not restored:
        return "\nNo job restored: nothing to account.\n"
    bench_s = sum(p.cold.client_ttft_s - p.cached.client_ttft_s for p in restored)
    worker_s = sum(p.counted["prefill_saved_ms"] - p.counted["restore_ms"] for p in restored) / 1000
    error = abs(worker_s - bench_s) / bench_s
    verdict = "met" if error <= ACCOUNT_TARGET else "MISSED"
    return (
        f"\nTime the restores saved, over the {len(restored)} jobs that restored: by the bench "
        f"(cold TTFT less cached TTFT) **{bench_s:.1f} s**; by the worker's counters "
        f"(`prefill_saved_ms` less `restore_ms`) **{worker_s:.1f} s**: {error:.0%} apart "
        f"(target ≤ {ACCOUNT_TARGET:.0%}: {verdict}).\n"
    )


def _decoding_text(rounds: list[tuple[DecodeRound, DecodeRound]]) -> str:
    ratios = per_round([on.mean_tok_s for on, _ in rounds], [off.mean_tok_s for _, off in rounds])
    median = statistics.median(ratios)
    verdict = "met" if median >= DECODE_TARGET else "MISSED"
    counted = [on.counted for on, _ in rounds]
    reports = [CacheReport(enabled=True, **c) for c in counted]
    shares = [s for on, off in rounds for s in (on.foreign, off.foreign)]
    return f"""
### Saves beside decoding

{CLIENTS} clients, {PER_CLIENT} new ~600-token documents each, {SAVES_TOKENS} tokens written,
greedy; the cache on the {SAVES_STORAGE} directory (each prompt's snapshot saved while other
streams decode) against the cache off, in alternating rounds. Streams' mean decode tok/s, cache
on: {_tok_s([on for on, _ in rounds])}; off: {_tok_s([off for _, off in rounds])}. **On over
off: {ratio_summary(ratios)}** (target ≥ {DECODE_TARGET:.2f}: {verdict}).

Per cache-on round, from the worker's counters: snapshots written {_each(counted, "saves")},
deferred {_each(counted, "saves_deferred")}, dropped {_each(counted, "saves_dropped")}; saver
CPU {", ".join(f"{c['save_ms'] / 1000:.1f} s" for c in counted)}; decode passes beside a save
against the same passes with none {_ratios(r.saving_step_ratio for r in reports)};
all decode time against its time with no save (the seeds' alarm: 1.15)
{_ratios(r.decode_vs_baseline for r in reports)}.
Foreign CPU per run: {shares_text(shares)}.
"""


def _each(counted: list[dict[str, int]], name: str) -> str:
    return ", ".join(str(c.get(name, 0)) for c in counted)


def _ratios(ratios: Iterable[float | None]) -> str:
    return ", ".join("–" if r is None else f"{r:.2f}×" for r in ratios)


def _tok_s(rounds: list[DecodeRound]) -> str:
    return ", ".join(f"{r.mean_tok_s:.1f}" for r in rounds)


HEADER = """## The prefix cache on slow storage

The cache directory on a loop device whose reads a blkio cgroup throttles (bench/cache_storage.py
says how); Qwen2.5-Coder-0.5B, full job path, greedy, 4 tokens. Before a state found on disk is
read, the worker compares what reading it would take (the bytes the page cache holds at the rate
restores from memory ran, the rest at the directory's uncached rate, probed at start and learned
from restores) with what prefilling its tokens would take (at its recent prefill chunks' rate),
and takes the cheaper (worker/restore_cost.py).
"""

TABLE_HEADER = """
### Restore or recompute, by prefix length

Per job: a new document prompt run cold (its snapshot written), then, with the worker's memory
forgotten and the cache's files out of the page cache, run again. Times to first token at the
client (medians over the rounds; the ratio is per job, median and range); the choice and the
worker's two estimates from the cached run's timings; "same answer": every cached run wrote its
cold run's text.

| storage | prefix (prompt tokens) | cold TTFT ms | with cache ms | cache / cold | choice | read est. ms | prefill est. ms | restore ms | same answer |
|---|---|---|---|---|---|---|---|---|---|
"""
