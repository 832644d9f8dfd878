"""The cells of a llama.cpp sequence state: where each cell's bytes are; states built of cells.

`llama_state_seq_get_data` on a plain-attention KV cache writes (`llama_kv_cache::state_write`,
`state_write_meta`, `state_write_data` in src/llama-kv-cache.cpp, llama.cpp as vendored by
llama-cpp-python 0.3.36)::

    u32 magic 0xaf143cd8, i32 seq_id          (llama_context::state_seq_get_data)
    u32 n_stream; per stream u32 cell_count and, when it is not 0:
      cell_count x (i32 pos, u32 n_seq_id = 1, i32 seq_id)       one sequence, no cell ext
      u32 v_trans, u32 n_layer
      n_layer x (i32 k_type, u64 k_row_bytes, cell_count K rows)
      v_trans 0: n_layer x (i32 v_type, u64 v_row_bytes, cell_count V rows)
      v_trans 1: n_layer x (i32 v_type, u32 el_bytes, u32 n_embd_v, n_embd_v x cell_count elements)

So everything that grows with the cells is a block of R rows of cell_count x unit bytes (R = 1,
except transposed V: one row per embedding column), and a state of N cells whose first M cells
are another state's is that state's blocks with N - M cells appended to every row. A layout
lists those blocks; `compose` builds one state from cell ranges of several states of the same
shape, with one copy of each byte. Anything else (a sliding-window cache, which writes two
caches; M-RoPE cell ext; a layer without V; several streams with cells) does not parse, and the
caller keeps the state whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_U32 = struct.Struct("<I")
_MAGIC = 0xAF143CD8  # llama-context.cpp's io_magic
_META = 12  # pos, n_seq_id, seq_id
_COMPARED_META = 8  # a restore reads no seq id (it uses its own): compare pos and n_seq_id only
_MAX_LAYERS = 4096
_MAX_STREAMS = 65536

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class Fixed:
    """Bytes that do not grow with the cells. `framing`: stream counts, which say which stream
    the sequence came from (a restore reads it into its own), taken from the newest state."""

    data: bytes
    framing: bool = False


@dataclass(frozen=True, slots=True)
class Count:
    """The stream's cell count."""


@dataclass(frozen=True, slots=True)
class Cells:
    offset: int
    rows: int
    unit: int  # bytes per cell in each row
    compared: int  # leading bytes of each unit that must match for two cells to be the same


Piece = Fixed | Count | Cells


@dataclass(frozen=True, slots=True)
class Layout:
    state: Bytes
    n_cells: int
    pieces: tuple[Piece, ...]

    def cells(self, piece: Cells) -> npt.NDArray[np.uint8]:
        """The block as (rows, cells, unit)."""
        size = piece.rows * self.n_cells * piece.unit
        block = self.state[piece.offset : piece.offset + size]
        return block.reshape(piece.rows, self.n_cells, piece.unit)

    def shape(self) -> tuple[object, ...]:
        """What two states must share for one's cells to extend the other's."""
        return tuple(
            (p.rows, p.unit) if isinstance(p, Cells) else ("count" if isinstance(p, Count) else p)
            for p in self.pieces
            if not (isinstance(p, Fixed) and p.framing)
        )


# (layout, first cell, end cell) in that layout's own cells.
Segment = tuple[Layout, int, int]


class _Reader:
    def __init__(self, data: Bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> int:
        """Advance over n bytes; their offset."""
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("state ends early")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str) -> tuple[int, ...]:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.data.data, start)

    def fixed(self, start: int) -> Fixed:
        return Fixed(self.data[start : self.pos].tobytes())


def parse(state: bytes | memoryview | Bytes) -> Layout | None:
    """The state's layout, or None when it is not one this module understands exactly."""
    data = np.frombuffer(state, dtype=np.uint8)
    try:
        return _parse(data)
    except (ValueError, struct.error):
        return None


def _parse(data: Bytes) -> Layout | None:
    r = _Reader(data)
    magic, _seq, n_stream = r.unpack("<IiI")
    if magic != _MAGIC or not 1 <= n_stream <= _MAX_STREAMS:
        return None
    pieces: list[Piece] = []
    framing_start, n_cells = 0, 0
    for _ in range(n_stream):
        count_at = r.pos
        (count,) = r.unpack("<I")
        if count == 0:
            continue
        if n_cells:
            return None  # cells in two streams: not one sequence's state
        n_cells = count
        pieces += [Fixed(data[framing_start:count_at].tobytes(), framing=True), Count()]
        pieces += _stream(r, count)
        framing_start = r.pos
    if not n_cells or r.pos != len(data):
        return None
    pieces.append(Fixed(data[framing_start:].tobytes(), framing=True))
    return Layout(data, n_cells, tuple(pieces))


def _stream(r: _Reader, n_cells: int) -> list[Piece]:
    meta = r.take(n_cells * _META)
    fields = r.data[meta : meta + n_cells * _META].view("<i4").reshape(n_cells, 3)
    if not (fields[:, 1] == 1).all():
        raise ValueError("a cell of several sequences, or cell ext: not a layout known here")
    pieces: list[Piece] = [Cells(meta, 1, _META, _COMPARED_META)]
    start = r.pos
    v_trans, n_layer = r.unpack("<II")
    if v_trans not in (0, 1) or not 1 <= n_layer <= _MAX_LAYERS:
        raise ValueError("not a KV cache's data")
    pieces.append(r.fixed(start))
    for _ in range(n_layer):
        pieces += _rows(r, n_cells)
    for _ in range(n_layer):
        pieces += _columns(r, n_cells) if v_trans else _rows(r, n_cells)
    return pieces


def _rows(r: _Reader, n_cells: int) -> list[Piece]:
    start = r.pos
    _type, row_bytes = r.unpack("<iQ")
    fixed = r.fixed(start)
    if row_bytes == 0:
        raise ValueError("empty rows")
    return [fixed, Cells(r.take(n_cells * row_bytes), 1, row_bytes, row_bytes)]


def _columns(r: _Reader, n_cells: int) -> list[Piece]:
    start = r.pos
    _type, el_bytes, n_embd = r.unpack("<iII")
    fixed = r.fixed(start)
    if el_bytes == 0 or n_embd == 0:
        raise ValueError("empty columns")
    return [fixed, Cells(r.take(n_embd * n_cells * el_bytes), n_embd, el_bytes, el_bytes)]


def composed_size(top: Layout, n_cells: int) -> int:
    return (
        sum(
            len(p.data) if isinstance(p, Fixed) else _U32.size if isinstance(p, Count) else 0
            for p in top.pieces
        )
        + sum(p.rows * p.unit for p in top.pieces if isinstance(p, Cells)) * n_cells
    )


def compose_into(top: Layout, segments: list[Segment], out: Bytes) -> None:
    """Write into `out` (composed_size bytes) the state holding `segments`' cells in order.

    Every segment's layout has `top`'s shape; the fixed bytes are `top`'s."""
    n_cells = sum(end - start for _, start, end in segments)
    pos = 0
    for i, piece in enumerate(top.pieces):
        if isinstance(piece, Fixed):
            out[pos : pos + len(piece.data)] = np.frombuffer(piece.data, dtype=np.uint8)
            pos += len(piece.data)
        elif isinstance(piece, Count):
            out[pos : pos + _U32.size] = np.frombuffer(_U32.pack(n_cells), dtype=np.uint8)
            pos += _U32.size
        else:
            size = piece.rows * n_cells * piece.unit
            block = out[pos : pos + size].reshape(piece.rows, n_cells, piece.unit)
            at = 0
            for layout, start, end in segments:
                theirs = layout.pieces[i]
                assert isinstance(theirs, Cells)
                block[:, at : at + end - start] = layout.cells(theirs)[:, start:end]
                at += end - start
            pos += size


def compose(top: Layout, segments: list[Segment]) -> Bytes:
    n_cells = sum(end - start for _, start, end in segments)
    out = np.empty(composed_size(top, n_cells), dtype=np.uint8)
    compose_into(top, segments, out)
    return out


def first_cells(layout: Layout, n_cells: int) -> Bytes | None:
    """The state of `layout`'s first `n_cells` cells, byte for byte what a capture holding only
    them gives (cells stay where computing more of the sequence put none before them); None
    unless those cells hold positions 0 to n_cells - 1 in order."""
    if not 0 < n_cells <= layout.n_cells:
        return None
    meta = next(p for p in layout.pieces if isinstance(p, Cells))
    positions = layout.cells(meta)[0, :n_cells, :4].copy().view("<i4").ravel()
    if not np.array_equal(positions, np.arange(n_cells)):
        return None
    return compose(layout, [(layout, 0, n_cells)])


def leading_equal(layout: Layout, segments: list[Segment], limit: int) -> int:
    """How many of `layout`'s first cells (at most `limit`) equal the segments' cells in order:
    every byte a restore reads, in every block."""
    k = min(limit, layout.n_cells, sum(end - start for _, start, end in segments))
    for i, piece in enumerate(layout.pieces):
        if not isinstance(piece, Cells):
            continue
        mine = layout.cells(piece)[:, :, : piece.compared]
        at = 0
        for other, start, end in segments:
            n = min(end - start, k - at)
            if n <= 0:
                break
            theirs_piece = other.pieces[i]
            assert isinstance(theirs_piece, Cells)
            theirs = other.cells(theirs_piece)[:, start : start + n, : piece.compared]
            same = _leading_same(mine[:, at : at + n], theirs)
            if same < n:
                k = at + same
                break
            at += n
    return k


def _leading_same(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> int:
    """How many leading cells (axis 1) two blocks of (rows, cells, bytes) have equal. Mostly
    all of them (a delta's base is the state's own prefix): one whole comparison says so, else
    equal prefixes are found by halving, a few whole comparisons more. A reduction per cell over
    rows and bytes was slow on transposed V (many rows of 2 bytes): most of a delta's save,
    which the saver's thread spends beside the next prompt's prefill (docs/BENCHMARKS.md,
    "where a restore's time goes")."""
    n = int(a.shape[1])
    if np.array_equal(a, b):
        return n
    equal, differs = 0, n
    while differs - equal > 1:
        mid = (equal + differs) // 2
        if np.array_equal(a[:, :mid], b[:, :mid]):
            equal = mid
        else:
            differs = mid
    return equal


def meta_range(layout: Layout) -> tuple[int, int]:
    """Byte range of the cells' metadata (whose seq ids a restore does not read)."""
    piece = next(p for p in layout.pieces if isinstance(p, Cells))
    return piece.offset, piece.offset + piece.unit * layout.n_cells
