"""Where prefill ends a chunk, and where it saves states: the rule that makes warm == cold.

A cell's values depend on the shape of the pass that computed it (llama.cpp's kernels sum in
another order for another row count: docs/BENCHMARKS.md, "Why prefill runs in canonical
chunks"). So every prefill, cold or after a restore, ends its chunks at the same points of the
prompt, whatever memory or the disk held: multiples of the cache's block, the prompt's breaks
(worker/prompt_breaks.py) and where prefill stops. A restore may then end only at a point both
the stored state's prefill and the new prompt's cold prefill ended a chunk at
(`shared.prefix_cache.restorable_tokens`; on kernels the start-up checks, also inside a
chunk), and every cell after it is computed as cold. `chunk_end` itself lives beside that rule,
in shared/prefix_cache. Where a prompt row reads alike in any pass (the start-up checks), no
cell depends on chunk ends and the Conclave frees them (`Conclave._chunk_end`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shared.prefix_cache import chunk_end


def chunk_ends(limit: int, block_tokens: int, breaks: Sequence[int]) -> Iterator[int]:
    """Every chunk end of a cold prefill up to `limit`, in order."""
    position = 0
    while position < limit:
        position = chunk_end(position, limit, block_tokens, breaks)
        yield position


def snapshot_points(
    breaks: Sequence[int],
    start: int,
    end: int,
    *,
    declared: bool,
    truncatable: bool,
    block_tokens: int,
    min_tokens: int,
) -> set[int]:
    """Where a prefill saves states. With a declared prefix, at its end. Else at the first and
    last break (a shared system prompt; a document before its question) and at the prefill's
    end (what the conversation's next turn extends): without breaks, the end alone. For
    memories that cannot be cut back, also the block boundary before the first point, so a
    longer prompt sharing this one's start finds a state it may restore."""
    first = min(breaks, default=end)
    points = {first}
    if not declared:
        points |= {max((b for b in breaks if b <= end), default=end), end}
    if not truncatable:
        points.add(first - first % block_tokens)
    return {p for p in points if start < p <= end and p >= min_tokens}
