"""Deltas: a state that extends a stored one is kept as its own cells and a reference to it.

Many prompts share a long start (a system prompt, a document before its questions), and a
whole state per prompt stores those cells once per prompt. A delta stores only the cells after
the longest run of leading cells it shares, byte for byte, with a stored blob (its base), so
storage grows with unique tokens. Workers prefill in canonical chunks, so equal leading tokens
computed in equally shaped chunks give equal cells; that is checked on the bytes, never assumed
(`plan`): cells that differ, a state whose layout does not parse (shared.prefix_cache.state_layout)
or a base that cannot be read means a whole blob.

A restore reads the chain (`resolve`: every base verified, named by key and by its payload
digest, chains at most MAX_DEPTH deep and strictly shallower at each step) and composes the
state with one copy of each byte into a buffer the thread keeps (`Composer`). A chain that
cannot be read (base missing, damaged or replaced) raises BrokenChain naming what to delete;
the lookup then goes on to the next shorter hit, so the job recomputes what is missing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from shared.prefix_cache.blobs import BlobStore
from shared.prefix_cache.format import (
    MAX_DEPTH,
    BaseRef,
    Header,
    blob_key,
    decode_blob,
    parse_name,
)
from shared.prefix_cache.keys import common_prefix_len, prefix_key
from shared.prefix_cache.state_layout import (
    Bytes,
    Layout,
    Segment,
    compose,
    compose_into,
    composed_size,
    leading_equal,
    meta_range,
    parse,
)

# Fewer shared cells are not worth a dependency (a second file to read on every restore).
MIN_SHARED_CELLS = 32


@dataclass(frozen=True, slots=True)
class Link:
    """One verified blob: its payload (a whole state, or a delta's own cells) and, when it is
    read as part of a chain, that payload's layout."""

    name: str
    header: Header
    tokens: list[int]
    payload: memoryview
    layout: Layout | None

    @property
    def shared(self) -> int:
        """Cells taken from the base (0 for a whole state)."""
        return 0 if self.header.base is None else self.header.base.shared


class BrokenChain(Exception):
    """A delta that can never be restored. `remove`: blobs to delete (name, tokens if known):
    the delta, every delta between it and the break, and a damaged base."""

    def __init__(self, reason: str, remove: list[tuple[str, list[int] | None]]) -> None:
        super().__init__(reason)
        self.remove = remove


def read_link(store: BlobStore, fp: str, name: str) -> tuple[bool, Link | None]:
    """(whether the file exists, the verified blob with its layout, or None when it is damaged
    or misnamed)."""
    data = store.get(blob_key(fp, name))
    if data is None:
        return False, None
    return True, link_from(fp, name, data, with_layout=True)


def link_from(fp: str, name: str, data: bytes | memoryview, *, with_layout: bool) -> Link | None:
    """The blob verified against its name. A delta's layout is always read (its cells parse:
    they were written from a parsed state); a whole state's only `with_layout` (a state that
    does not parse is still restorable whole, it just cannot be a base)."""
    parsed = parse_name(name)
    decoded = decode_blob(data, fp)
    if parsed is None or decoded is None:
        return None
    header, tokens, payload = decoded
    if header.n_tokens != parsed[0] or prefix_key(tokens, header.block_tokens, fp) != parsed[1]:
        return None  # intact file under the wrong name
    layout = parse(payload) if with_layout or header.base is not None else None
    if layout is None and header.base is not None:
        return None
    return Link(name, header, tokens, payload, layout)


def resolve(store: BlobStore, fp: str, top: Link) -> list[Link]:
    """`top` and its bases down to a whole state, each checked against the reference to it."""
    chain = [top]
    while (ref := chain[-1].header.base) is not None:
        dependents: list[tuple[str, list[int] | None]] = [(d.name, d.tokens) for d in chain]
        exists, base = read_link(store, fp, ref.name)
        if not exists:
            raise BrokenChain(f"base {ref.name} is gone", dependents)
        if base is None:
            raise BrokenChain(f"base {ref.name} is damaged", [*dependents, (ref.name, None)])
        if not _stands_on(chain[-1], ref, base, top.layout):
            raise BrokenChain(f"base {ref.name} is not the one written under", dependents)
        chain.append(base)
    return chain


def _stands_on(link: Link, ref: BaseRef, base: Link, top: Layout | None) -> bool:
    expected = base.header.n_tokens - base.shared
    return (
        base.layout is not None
        and top is not None
        and base.header.payload_digest == ref.payload_digest
        and base.header.depth < ref.depth  # strictly shallower: every chain ends
        and base.header.block_tokens == link.header.block_tokens
        and base.layout.n_cells == expected
        and base.tokens[: ref.shared] == link.tokens[: ref.shared]
        and base.layout.shape() == top.shape()
    )


def segments(chain: list[Link], upto: int) -> list[Segment]:
    """The cell ranges, in order, of the first `upto` cells of `chain[0]`'s state."""
    out: list[Segment] = []
    for link in chain:
        assert link.layout is not None  # resolve() and plan() read every layout of a chain
        if upto > link.shared:
            out.append((link.layout, 0, upto - link.shared))
            upto = link.shared
        if upto == 0:
            break
    return out[::-1]


def n_cells(chain: list[Link]) -> int:
    return chain[0].header.n_tokens


class Composer:
    """Composes restored states into a buffer each thread keeps: a fresh buffer of tens of MB
    costs more in page faults than the copy itself. A composed state is valid until the same
    thread composes the next one (a worker restores a hit before it looks up another)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def compose(self, chain: list[Link]) -> memoryview:
        top, total = chain[0].layout, n_cells(chain)
        assert top is not None
        size = composed_size(top, total)
        buffer: Bytes | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = np.empty(size, dtype=np.uint8)
            self._local.buffer = buffer
        compose_into(top, segments(chain, total), buffer[:size])
        return buffer[:size].data.toreadonly()


@dataclass(frozen=True, slots=True)
class Plan:
    """A delta to write: its own cells on `chain[0]`'s first `shared`."""

    chain: list[Link]
    shared: int
    payload: bytes

    def ref(self) -> BaseRef:
        base = self.chain[0].header
        n, blob_id = parse_name(self.chain[0].name) or (0, "")
        return BaseRef(n, blob_id, base.payload_digest, self.shared, base.depth + 1)


def plan(
    store: BlobStore,
    fp: str,
    tokens: list[int],
    state: bytes,
    candidates: Iterable[str],
    enough: int,
) -> Plan | None:
    """The delta to write for `state` (covering `tokens`) on the best candidate, if any shares
    at least MIN_SHARED_CELLS leading cells with it, byte for byte. Candidates are read in
    order until one shares `enough` (each is a whole blob read: the rest could add less than
    a block)."""
    layout = parse(state)
    if layout is None or layout.n_cells != len(tokens):
        return None
    best: tuple[list[Link], int] | None = None
    for name in candidates:
        found = _shared_with(store, fp, name, tokens, layout)
        if found is not None and (best is None or _better(found, best)):
            best = found
        if best is not None and best[1] >= enough:
            break
    if best is None:
        return None
    chain, shared = best
    own = compose(layout, [(layout, shared, layout.n_cells)]).tobytes()
    own_layout = parse(own)
    if own_layout is None:
        return None
    rebuilt = compose(own_layout, [*segments(chain, shared), (own_layout, 0, own_layout.n_cells)])
    if not _same_state(rebuilt, layout):
        return None  # the layout was misread: never store what would not restore the state
    return Plan(chain, shared, own)


def _shared_with(
    store: BlobStore, fp: str, name: str, tokens: list[int], layout: Layout
) -> tuple[list[Link], int] | None:
    """(the chain to stand on, cells shared) for one candidate, or None if not worth it."""
    _, link = read_link(store, fp, name)
    if link is None or link.layout is None or link.layout.shape() != layout.shape():
        return None
    try:
        chain = resolve(store, fp, link)
    except BrokenChain:
        return None  # a lookup that finds it repairs it
    # Always one cell of its own: a state inside a stored one is still its own blob (a name a
    # lookup finds, restorable in full even where the longer one could only be cut back).
    limit = min(common_prefix_len(link.tokens, tokens), len(tokens) - 1)
    shared = leading_equal(layout, segments(chain, limit), limit)
    # The first cells of a delta whose base holds them all are the base's: name that one, so
    # chains stay short (every prompt after a system prompt stands on the system prompt).
    while chain[0].shared >= shared and len(chain) > 1:
        chain = chain[1:]
    # Too deep: stand on a shallower blob of the chain, for the cells it holds of ours.
    while chain[0].header.depth + 1 > MAX_DEPTH:
        shared, chain = min(shared, chain[0].shared), chain[1:]
    return (chain, shared) if shared >= MIN_SHARED_CELLS else None


def _better(a: tuple[list[Link], int], b: tuple[list[Link], int]) -> bool:
    """More shared cells, then a shorter chain."""
    return (a[1], -a[0][0].header.depth) > (b[1], -b[0][0].header.depth)


def _same_state(rebuilt: Bytes, layout: Layout) -> bool:
    """Byte for byte, except the cells' seq ids, which a restore does not read (a base written
    from another sequence holds its own)."""
    start, end = meta_range(layout)
    original = layout.state
    if len(rebuilt) != len(original):
        return False
    if not (np.array_equal(rebuilt[:start], original[:start])) or not np.array_equal(
        rebuilt[end:], original[end:]
    ):
        return False
    mine = parse(rebuilt)
    everything = layout.n_cells
    return mine is not None and leading_equal(mine, [(layout, 0, everything)], everything) == (
        everything
    )
