"""Cold versus warm time to first token through the full job path, and what the cache stores.

Every measurement uses a freshly started worker process, so nothing is in the model's memory:
a warm start can only come from the shared cache directory. "Disk" runs first ask the kernel to
drop the blobs from the page cache (posix_fadvise DONTNEED after sync).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import orjson
from httpx_sse import connect_sse

from shared.prefix_cache import common_prefix_len
from shared.prefix_cache.blobs import DirectoryBlobStore
from shared.prefix_cache.format import parse_head
from shared.schemas import JobRequest
from shared.settings import Settings
from shared.submission import work_order_for
from tests.harness import Stack
from worker.main import build_conclave


def document(n_items: int, seed: int) -> str:
    lines = [
        f"Line {i}: order #{(i * 7919 + seed) % 100000} from customer {(i * 31 + seed) % 977}, "
        f"{(i * 13 + seed) % 50 + 1} units of SKU-{(i * 17 + seed) % 4000:04d}, "
        f"status {'shipped' if (i + seed) % 3 else 'pending'}."
        for i in range(n_items)
    ]
    return "Purchase order ledger:\n" + "\n".join(lines) + "\nHow many lines are pending? Answer:"


@dataclass(frozen=True, slots=True)
class Run:
    client_ttft_s: float
    job: dict[str, Any]


def timed_job(stack: Stack, prompt: str | dict[str, Any]) -> Run:
    """Submit and follow a job; time to first token at the client. `prompt`: text or a body."""
    body = prompt if isinstance(prompt, dict) else {"prompt": prompt}
    body = {"max_tokens": 4, "temperature": 0, **body}
    with httpx.Client(base_url=stack.url, timeout=600) as client:
        started = time.perf_counter()
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        first: float | None = None
        with connect_sse(client, "GET", f"/v1/jobs/{job_id}/events") as source:
            for sse in source.iter_sse():
                if sse.event == "token" and first is None:
                    first = time.perf_counter()
                if sse.event in ("done", "error"):
                    final = orjson.loads(sse.data)
                    break
    assert final["status"] == "finished", final
    assert first is not None
    return Run(first - started, final)


def drop_from_page_cache(directory: Path) -> None:
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh_worker(stack: Stack, n: int) -> int:
    stack.stop_process(f"worker-{n}")
    stack.start_worker(f"worker-{n + 1}")
    return n + 1


def ttft_rows(settings: Settings, log_dir: Path, sizes: dict[str, int], rounds: int) -> list[str]:
    stack = Stack(settings, log_dir)
    rows = []
    try:
        stack.start_api()
        stack.start_worker("worker-1")
        worker = 1
        for label, n_items in sizes.items():
            samples: list[tuple[Run, Run, Run]] = []
            for r in range(rounds):
                prompt = document(n_items, seed=1000 * r + n_items)
                worker = fresh_worker(stack, worker)
                cold = timed_job(stack, prompt)
                worker = fresh_worker(stack, worker)  # stopping flushes the snapshot to disk
                warm = timed_job(stack, prompt)
                worker = fresh_worker(stack, worker)
                drop_from_page_cache(settings.cache_dir)
                disk = timed_job(stack, prompt)
                samples.append((cold, warm, disk))
            rows.append(_ttft_row(label, samples))
    finally:
        stack.stop()
    return rows


def _ttft_row(label: str, samples: list[tuple[Run, Run, Run]]) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    cold = med([c.client_ttft_s for c, _, _ in samples])
    warm = med([w.client_ttft_s for _, w, _ in samples])
    disk = med([d.client_ttft_s for _, _, d in samples])
    ratio_warm = med([c.client_ttft_s / w.client_ttft_s for c, w, _ in samples])
    ratio_disk = med([c.client_ttft_s / d.client_ttft_s for c, _, d in samples])
    restore = med([w.job["timings"]["restore_ms"] for _, w, _ in samples])
    restore_disk = med([d.job["timings"]["restore_ms"] for _, _, d in samples])
    prompt = samples[0][0].job["usage"]["prompt_tokens"]
    cached = samples[0][1].job["usage"]["cached_tokens"]
    same = all(
        c.job["result"]["text"] == w.job["result"]["text"] == d.job["result"]["text"]
        for c, w, d in samples
    )
    # The target is stated for the ~3000-token prefix only.
    verdict = ""
    if prompt >= 2500:
        verdict = " (meets ≥ 100×)" if ratio_warm >= 100 else " (MISSES ≥ 100×)"
    return (
        f"| {label} | {prompt} | {cached} | {cold * 1000:.0f} | {warm * 1000:.0f} | "
        f"**{ratio_warm:.0f}×**{verdict} | {restore:.0f} | {disk * 1000:.0f} | "
        f"{ratio_disk:.0f}× | {restore_disk:.0f} | {'yes' if same else 'NO'} |"
    )


TTFT_HEADER = """## Prefix cache: cold versus warm time to first token

Full job path (HTTP → Redis/rq → worker → SSE), time to first token measured at the client, for
one document prompt, each run on a freshly started worker process (nothing in the model's
memory). Cold: no cache entry. Warm: the entry the cold run wrote, file in the page cache.
Disk: the same after `posix_fadvise(DONTNEED)` on every cache file (on this VM the host may still
cache the virtual disk, so "disk" may be faster than a real cold read). Medians over the rounds;
ratios are per round. Target: warm ≥ 100× faster than cold on a ~3000-token prefix.

| document | prompt tokens | restored tokens | cold TTFT ms | warm TTFT ms | cold/warm | restore ms | disk TTFT ms | cold/disk | restore ms (disk) | same answer |
|---|---|---|---|---|---|---|---|---|---|---|
"""


def storage_section(settings: Settings, n_docs: int) -> str:
    """Bytes on disk for many documents sharing one system prompt (in-process engine)."""
    system = "You extract fields from purchase orders. " + document(10, seed=7).split("\n", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        local = settings.model_copy(
            update={"cache": settings.cache.model_copy(update={"dir": Path(tmp)})}
        )
        engine = build_conclave(local)
        llama, cache, saver = engine.llama, engine.cache, engine.saver
        assert cache is not None and saver is not None
        total_tokens = 0
        for i in range(n_docs):
            engine.forget()
            prompt = f"{system}\nDocument {i}:\n{document(8, seed=i)}"
            request = JobRequest(prompt=prompt, max_tokens=1, temperature=0)
            order = work_order_for(llama, request, n_ctx=local.n_ctx, default_max_tokens=1)
            total_tokens += engine.generate(order, lambda _i, _t: False).usage.prompt_tokens - 1
        saver.flush()
        stats = cache.stats()
        stored = stored_blobs(Path(tmp), cache.fingerprint)
        system_tokens = len(llama.tokenize(system.encode(), add_bos=True, special=True))
        engine.close()
    unique = unique_tokens([tokens for tokens, _ in stored])
    per_token = max(size / len(tokens) for tokens, (size, base) in stored if base is None)
    deltas = sum(base is not None for _, (_, base) in stored)
    ratio = stats.bytes / (unique * per_token)
    verdict = "meets ≤ 1.05" if ratio <= 1.05 else "MISSES ≤ 1.05"
    per_saved = stats.bytes / total_tokens / 1024
    return f"""## Prefix cache: storage

{n_docs} documents sharing one {system_tokens}-token system prompt ({settings.model}, in-process
engine, each document's prompt saved once, {total_tokens} prompt tokens in all): **{stats.entries}
entries ({deltas} of them deltas), {stats.bytes / 1e6:.1f} MB on disk, {per_saved:.1f} KiB per
saved token**. The saved prompts hold {unique} unique tokens (a token counts once however many
saved prompts start with the same ones) at {per_token / 1024:.1f} KiB each in a
whole blob: bytes on disk are **{ratio:.3f}×** unique tokens × bytes per token ({verdict}, the
issue's target). A snapshot that extends a stored prefix stores only its own cells, on the
longest run of leading cells it shares byte for byte with a stored blob (a delta,
shared/prefix_cache/deltas.py); a restore composes the chain.
"""


def stored_blobs(root: Path, fp: str) -> list[tuple[list[int], tuple[int, object]]]:
    """Every blob's tokens, with its size and base reference (None: a whole state)."""
    store = DirectoryBlobStore(root)
    out: list[tuple[list[int], tuple[int, object]]] = []
    for entry in store.scan(f"{fp}/blobs/"):
        data = store.get(entry.key)
        parsed = None if data is None else parse_head(data, fp)
        if parsed is not None:
            out.append((parsed[1], (entry.size_bytes, parsed[0].base)))
    return out


def unique_tokens(prefixes: list[list[int]]) -> int:
    """Distinct token prefixes among the saved prompts: the nodes of their trie. In sorted
    order each shares the most with its neighbour, so that is all it does not add."""
    ordered = sorted(prefixes)
    shared = sum(common_prefix_len(a, b) for a, b in pairwise(ordered))
    return sum(len(p) for p in ordered) - shared
