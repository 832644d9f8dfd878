#!/usr/bin/env bash
# Builds the llama-cpp-python wheel granary runs, into OUT_DIR. Used by the Makefile and the
# Dockerfile, so a machine and an image run the same kernels.
#
#   deploy/build-llama-wheel.sh OUT_DIR [row-invariant|stock|batch-invariant]
#
# llama-cpp-python ships as an sdist only. Its vendored llama.cpp is built with a few one-line
# edits (each fails the build if its text is not found): the CPU kernels whose code path
# depends on the number of rows in a batch (llamafile's sgemm from 2 rows, except for the
# types where its arithmetic is vec_dot's; repacked weights' gemm and its 4-row interleaved
# quantisation of the activations from 4; the tiled K-quant path from 8; ARM's two-row mmla
# dot from 2) start at ROWS rows instead, flash attention tiles every pass and splits a decode
# row's cells only at fixed segments (deploy/llama-flash-attn-tiles.patch), and the one-row
# kernels of Q6_K, Q4_1 and repacked Q4_K take several rows, unpacking each weight block once
# for all of them (deploy/llama-kquant-rows.patch). A decode step of fewer rows then computes
# each row as a lone decode does, bit for bit, so the Conclave batches jobs without near-tie
# replays (worker/conclave/row_check.py checks it at start-up). Prompt chunks take the batched
# paths at any row count, padding repacked weights' last rows into a group of 4
# (deploy/llama-prompt-rows.patch): a prompt row reads alike whatever shares its pass. For
# bench/batch_rows.py only: `stock` builds the sdist unchanged, `batch-invariant` without
# llamafile's sgemm.
#
# On x86_64 the CPUs here advertise AMX the sandbox cannot run (SIGSEGV in
# ggml_backend_amx_mul_mat); gcc rejects those flags on ARM, where the plain native build is right.
set -euo pipefail

VERSION=0.3.36
ROWS=32
OUT_DIR=$1
VARIANT=${2:-row-invariant}
PIP=${PIP:-pip}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PIP" download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src=$work/llama_cpp_python-$VERSION
cpu=$src/vendor/llama.cpp/ggml/src/ggml-cpu

# edit FILE OLD NEW: replace the one line holding OLD (fixed text) by the same line with NEW.
edit() {
  local file=$1 old=$2 new=$3
  if [ "$(grep -cF -- "$old" "$file")" != 1 ]; then
    echo "$file: not exactly one '$old' to patch" >&2
    exit 1
  fi
  OLD=$old NEW=$new perl -pi -e 's/\Q$ENV{OLD}\E/$ENV{NEW}/' "$file"
}

if [ "$VARIANT" = row-invariant ]; then
  # One global, read by every patched kernel at each call: the row count from which they take
  # their batched path. 32 (the default) for decode steps; granary sets it to 0 around a prompt
  # chunk's passes (worker/kernels.py), whose values depend on the chunk alone, never on what
  # is decoded beside it: there every kernel takes its batched path (below), from one row.
  rows='granary_exact_rows'
  edit "$cpu/ggml-cpu-impl.h" 'struct ggml_compute_params {' \
    "__attribute__((visibility(\"default\"))) extern int $rows;
struct ggml_compute_params {"
  printf '\n__attribute__((visibility("default"))) int %s = %d;\n' "$rows" "$ROWS" >>"$cpu/ggml-cpu.c"
  # llamafile's Q8_0, Q5_0 and Q4_0 kernels on AVX2 with FMA compute each output as
  # ggml_vec_dot_{q8_0,q5_0,q4_0}_q8_0 do: per 32-value block the same integer dot in the same
  # lanes, scaled by the same product of the two deltas, added by one FMA into one 8-lane sum,
  # blocks in order, then the same horizontal add. A row's value is then the lone row's whatever
  # the tile, so these keep llamafile's own threshold (2 rows): most of Qwen2.5's and Gemma-3's
  # weights. Elsewhere (ARM's vec_dot sums two blocks apart) they wait for ROWS like the rest;
  # the worker's row check at start-up (worker/conclave/row_check.py) tests the claim per host.
  edit "$cpu/llamafile/sgemm.cpp" '    if (n < 2)' \
    "    if (n < 2 || (n < $rows && !granary_rows_invariant(Atype)))"
  edit "$cpu/llamafile/sgemm.cpp" 'bool llamafile_sgemm(' \
    "static inline bool granary_rows_invariant(int type) {
#if defined(__AVX2__) && defined(__FMA__)
    return type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q4_0;
#else
    (void) type;
    return false;
#endif
}

bool llamafile_sgemm("
  # Flash attention: a lone query row of one sequence past 512 cells splits its cells among
  # the threads and merges their partial sums, a row beside other sequences does not. No pass
  # takes that split: the patch below splits every decode row at the same fixed segments
  # instead, and reads a prompt chunk's rows in tiles, so a row's sums run in one order
  # whatever shares its pass.
  edit "$cpu/ops.cpp" 'const bool use_split_kv_path = !use_ref &&' \
    "const bool use_split_kv_path = false && !use_ref &&"
  # Flash attention (deploy/llama-flash-attn-tiles.patch) takes its tiled path for every pass,
  # not from 64 query rows: below, the sdist walks every cached cell one row at a time, with an
  # exp and an fp16 multiply-add per cell (after a 3,000-token document a decode step cost 2.1
  # times its cost without flash attention, a 32-token chunk 5.3 times). A tile computes only
  # its rows (the sdist: always 64) and holds the query rows of every head that reads one K/V
  # head, so a decode step converts each K/V tile once for the whole group. Each output is
  # summed per row in one order whatever the tile's rows. A decode pass sums each row over
  # fixed 512-cell segments and merges them in order: both threads work on a lone row, and the
  # row reads the same alone or beside other rows (docs/BENCHMARKS.md, "Flash attention by
  # the rows of a pass").
  patch -p1 -s -d "$src/vendor/llama.cpp" <"$(dirname "$0")/llama-flash-attn-tiles.patch"
  # Q6_K, Q4_1 and repacked Q4_K weights against a pass's rows (deploy/llama-kquant-rows.patch,
  # which also leaves repacked weights' rows below ROWS to gemv): the one-row kernel's exact
  # arithmetic per output, the weights' unpacking done once for several rows instead of once per row.
  patch -p1 -s -d "$src/vendor/llama.cpp" <"$(dirname "$0")/llama-kquant-rows.patch"
  edit "$cpu/repack.cpp" '        if (nrows > 3) {' "        if (nrows > 3 && nrows >= $rows) {"
  edit "$cpu/repack.cpp" 'i11 < ne11 - ne11 % 4;' "i11 < (ne11 >= $rows ? ne11 - ne11 % 4 : 0);"
  edit "$cpu/repack.cpp" 'i11_processed = ne11 - ne11 % 4;' \
    "i11_processed = ne11 >= $rows ? ne11 - ne11 % 4 : 0;"
  # The tiled K-quant path: from ROWS rows in a decode step, for any row count in a prompt
  # chunk's pass (its arithmetic per row is not vec_dot's).
  edit "$cpu/tiled/tiled.cpp" 'return rows >= 8 ||' "return $rows == 0 || (rows >= 8 && rows >= $rows) ||"
  edit "$cpu/ggml-cpu.c" 'if ((nr0 % 2 != 0) || (ne11 % 2 != 0)' \
    "if ((ne11 < $rows) || (nr0 % 2 != 0) || (ne11 % 2 != 0)"
  # A prompt chunk's pass: repacked weights' last rows (past the last group of 4) through
  # gemm as well, padded (deploy/llama-prompt-rows.patch).
  patch -p1 -s -d "$src/vendor/llama.cpp" <"$(dirname "$0")/llama-prompt-rows.patch"
elif [ "$VARIANT" = batch-invariant ]; then
  extra=-DGGML_LLAMAFILE=OFF
elif [ "$VARIANT" != stock ]; then
  echo "unknown variant '$VARIANT'" >&2
  exit 2
fi

if [ "$(uname -m)" = x86_64 ]; then
  no_amx='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
  export CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx' ${extra:-}"
else
  export CMAKE_ARGS="-DGGML_NATIVE=ON ${extra:-}"
fi
echo "building llama-cpp-python $VERSION ($VARIANT; 4-5 minutes on 2 cores)..."
"$PIP" wheel -q --no-deps --no-cache-dir -w "$OUT_DIR" "$src"
