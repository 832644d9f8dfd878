"""The worker's start-up check that a decode step's rows equal the same rows decoded alone, on
the wheel `make install` builds (deploy/build-llama-wheel.sh)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt
import orjson
import pytest
from llama_cpp import Llama

from shared.settings import Settings
from tests.conftest import DATA_DIR
from worker.conclave.row_check import (
    PAST_PADDED_WINDOW,
    batched_rows_equal_lone,
    prompt_pieces_share_passes,
    read_rows,
    row_counts,
    slice_granule,
)
from worker.decode_batch import llama_batch
from worker.kernels import exact_rows, prompt_chunk_kernels
from worker.main import build_conclave
from worker.model import load_model

# The rows' arithmetic must not depend on how the kernels split a pass among threads either.
pytestmark = pytest.mark.all_cores


@contextlib.contextmanager
def loaded(model: str, n_seq: int, n_ctx: int = 512) -> Iterator[Llama]:
    settings = Settings(model=model, data_dir=DATA_DIR, n_ctx=n_ctx)
    llama = load_model(settings, n_seq)
    try:
        yield llama
    finally:
        llama.close()


def check(model: str, n_seq: int, long_cells: int = 0, n_ctx: int = 512) -> bool:
    with loaded(model, n_seq, n_ctx) as llama:
        return batched_rows_equal_lone(llama, n_seq, long_cells)


def test_steps_of_up_to_31_rows_equal_their_rows_decoded_alone() -> None:
    assert check("smollm2-135m", 31)


def test_a_short_row_beside_a_sequence_past_the_padded_window_equals_it_alone() -> None:
    # Beside a sequence of 260 cells a step's attention window is 512 cells, not 256.
    assert check("smollm2-135m", 8, long_cells=PAST_PADDED_WINDOW)


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_rows_beside_a_sequence_past_one_attention_segment_equal_lone_rows(model: str) -> None:
    # A decode pass reads its cells in segments of 512 and merges each row's segments in order
    # (deploy/llama-flash-attn-tiles.patch). Beside a sequence of 600 cells every row's window
    # spans two segments, the second wholly masked for the short rows; alone, a short row's
    # window is one segment and the long row's two.
    assert check(model, 8, long_cells=600, n_ctx=1024)


@pytest.mark.qwen
def test_qwens_steps_of_2_to_31_rows_batch_its_q8_0_q5_0_and_q6_k_weights_equal_lone_rows() -> None:
    # On AVX2 llamafile's kernels for Q8_0 and Q5_0 run from 2 rows (deploy/build-llama-wheel.sh)
    # and Q6_K's unpack a weight block once for all rows (deploy/llama-kquant-rows.patch): rows
    # beside a sequence past the padded window still equal their lone selves.
    assert check("qwen2.5-coder-0.5b", 31, long_cells=PAST_PADDED_WINDOW)


@pytest.mark.qwen
def test_a_step_of_32_rows_or_more_takes_the_batch_kernels_and_the_check_sees_it() -> None:
    # The patched thresholds are 32 rows: from there Qwen's Q4_K and Q6_K weights take
    # llama.cpp's batch kernels, whose rows differ from lone ones (its Q8_0 and Q5_0 ones batch
    # from 2 rows, as lone rows compute). The check must say so, or it could not catch a stock
    # wheel.
    assert not check("qwen2.5-coder-0.5b", 40)


@pytest.mark.qwen
def test_prompt_chunks_take_the_batch_kernels_and_decode_steps_the_exact_ones_again() -> None:
    # The switch reaches the kernels: inside it a lone row takes the batch path (Qwen's Q4_K
    # weights through gemm, padded: deploy/llama-prompt-rows.patch), whose logits differ from
    # the one-row path's; every row count computes each row alike there too. After it, the
    # exact path.
    threshold = exact_rows()
    assert threshold is not None, "the installed wheel was built without granary's switch"
    assert threshold.value == 32
    with loaded("qwen2.5-coder-0.5b", 8) as llama:
        decode_step = lone_logits(llama)
        with prompt_chunk_kernels():
            assert not np.array_equal(lone_logits(llama), decode_step)
            assert batched_rows_equal_lone(llama, 8)
        assert threshold.value == 32
        assert np.array_equal(lone_logits(llama), decode_step)
        assert batched_rows_equal_lone(llama, 8)


def lone_logits(llama: Llama) -> npt.NDArray[np.float32]:
    """A prompt's last token decoded alone, in the kernels' current mode, after the rest is
    read as a chunk: its logits. Memory is cleared afterwards."""
    tokens = llama.tokenize(b"Granary keeps what it has read, and reads it once.", add_bos=False)
    rows = [(t, p, 0) for p, t in enumerate(tokens)]
    with llama_batch(len(tokens)) as batch:
        try:
            read_rows(llama, batch, rows[:-1])
            return read_rows(llama, batch, rows[-1:], [0], prompt=False)[0]
        finally:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llama.ctx), True)


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_prompt_pieces_of_several_sequences_read_in_one_pass_as_alone(model: str) -> None:
    with loaded(model, 3) as llama:
        assert prompt_pieces_share_passes(llama)
    with loaded(model, 2) as llama:  # too few sequences for the check's pieces
        assert not prompt_pieces_share_passes(llama)


def test_with_flash_attention_rows_beside_a_sequence_past_the_padded_window_equal_lone_rows(
    tmp_path: Path,
) -> None:
    """Stock flash attention splits a lone row's window among threads from 512 cells (a row of
    260 cells reads a window padded to 512), never a row beside others; the wheel `make
    install` builds never splits a decode row. The worker checks that case with flash attention
    on, and finds rows equal. (A data directory of its own: no answer kept from an earlier
    worker stands in for the check, and the worker keeps the ones it found.)"""
    settings = Settings(
        model="smollm2-135m",
        data_dir=tmp_path,
        n_ctx=512,
        flash_attn=True,
        cache={"enabled": False},
        worker={"max_active_jobs": 4},
    )
    engine = build_conclave(settings)
    try:
        assert engine.conclave.rows_invariant
    finally:
        engine.close()
    kept = orjson.loads((tmp_path / "row-checks.json").read_bytes())
    # The row check's answer, and where restores may end inside a chunk (the slice check).
    assert {key.split(":")[0]: type(answer) for key, answer in kept.items()} == {
        "rows": bool,
        "slices": int,
        "shared": bool,
    }
    assert [answer for key, answer in kept.items() if key.startswith("rows:")] == [True]


def test_the_check_covers_where_stock_kernels_switch_and_the_widest_step() -> None:
    assert row_counts(12) == [2, 3, 4, 8, 12]
    assert row_counts(3) == [2, 3]
    assert row_counts(1) == []


def test_a_batch_too_small_for_the_slice_checks_chunk_finds_no_granule() -> None:
    # Prompt chunks of 64 tokens at most: no chunk to cut back inside, and no check to fail.
    settings = Settings(model="smollm2-135m", data_dir=DATA_DIR, n_ctx=512, n_batch=64)
    llama = load_model(settings, 1)
    try:
        assert slice_granule(llama) is None
    finally:
        llama.close()
