"""What a verified draft costs, and whether batched rows can be made to equal rows decoded alone.

After a 700-token prompt, the next 16 tokens are decoded one at a time (plain decoding), then
again as one batch of n rows (speculative verification's shape). For each n: the largest
difference between a row's logits in the batch and the same token's logits decoded alone, and
the time of one pass of n rows against one of a single row (median of 5). Also prefill speed.

Kernel setups, each in its own process: the wheel `make install` builds (row-invariant: the
three kernels that pick their code path by the number of rows are taken only from 32 rows up,
deploy/build-llama-wheel.sh); the stock sdist (`make wheel-stock`); a batch-invariant one
(`make wheel-invariant`): llama.cpp built without llamafile's sgemm, and run without weight
repacking (`use_extra_bufts`) or the tiled K-quant path (`GGML_CPU_TILED_MM=0`), so every
output element is one dot product whatever the batch.

`python -m bench.batch_rows MODEL DATA_DIR [--threads N] [--no-repack]` measures one model and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import Llama

from shared.llm import load_llama
from shared.settings import Settings
from worker.decode_batch import fill_batch, llama_batch

ROWS = (1, 2, 3, 4, 8, 12, 16)
PROMPT_TOKENS = 700
REPEATS = 5
TEXT = " ".join(
    f"Item {i}: a crate of {i * 7 % 13} pears for shop {i % 5}, sent on day {i * 3 % 29}."
    for i in range(60)
)


@dataclass(frozen=True, slots=True)
class RowCost:
    rows: int
    drift: float
    pass_ms: float


@dataclass(frozen=True, slots=True)
class Measured:
    prefill_tok_s: float
    costs: list[RowCost]


class _Decoder:
    def __init__(self, llama: Llama, batch: llama_cpp.llama_batch) -> None:
        self.llama, self.batch = llama, batch
        self.memory = llama_cpp.llama_get_memory(llama.ctx)

    def decode(self, tokens: Sequence[int], start: int, logits: bool) -> None:
        fill_batch(self.batch, [(t, start + i, 0) for i, t in enumerate(tokens)], logits)
        if llama_cpp.llama_decode(self.llama.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def row(self, i: int) -> np.ndarray:
        pointer = llama_cpp.llama_get_logits_ith(self.llama.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self.llama.n_vocab(),)).copy()

    def cut(self, start: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, 0, start, -1)

    def timed(self, tokens: Sequence[int], start: int, logits: bool) -> float:
        times = []
        for _ in range(REPEATS):
            self.cut(start)
            started = time.perf_counter()
            self.decode(tokens, start, logits)
            times.append(time.perf_counter() - started)
        return float(np.median(times))


def measure(settings: Settings) -> Measured:
    llama = load_llama(settings)
    tokens = llama.tokenize(TEXT.encode(), add_bos=True, special=True)[:PROMPT_TOKENS]
    prompt_end = len(tokens) - 1
    chunk = 256
    with llama_batch(llama.n_batch) as batch:
        dec = _Decoder(llama, batch)
        prefill_s = dec.timed(tokens[:chunk], 0, logits=False)
        dec.cut(0)
        for start in range(0, prompt_end, chunk):
            dec.decode(tokens[start : min(prompt_end, start + chunk)], start, logits=False)
        alone, seq = [], [tokens[-1]]
        for i in range(max(ROWS)):
            dec.decode(seq[-1:], prompt_end + i, logits=True)
            alone.append(dec.row(0))
            seq.append(int(alone[-1].argmax()))
        costs = []
        for n in ROWS:
            dec.cut(prompt_end)
            dec.decode(seq[:n], prompt_end, logits=True)
            drift = max(float(np.abs(dec.row(i) - alone[i]).max()) for i in range(n))
            ms = dec.timed(seq[:n], prompt_end, logits=True) * 1000
            costs.append(RowCost(n, drift, ms))
    llama.close()
    return Measured(chunk / prefill_s, costs)


def _without_repack() -> None:
    """llama-cpp-python has no argument for llama_model_params.use_extra_bufts."""
    default = llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        value: llama_cpp.llama_model_params = default()
        value.use_extra_bufts = False
        return value

    # Llama.__init__ calls it through the llama_cpp.llama_cpp module.
    llama_cpp.llama_cpp.llama_model_default_params = params


@dataclass(frozen=True, slots=True)
class Setup:
    """A kernel setup: which llama-cpp-python, and what is turned off at run time."""

    site: Path | None  # None: the venv's own wheel
    no_repack: bool = False
    no_tiled: bool = False


def _run(settings: Settings, setup: Setup) -> Measured:
    """One model in a fresh process, with one kernel setup."""
    command = [sys.executable, "-m", "bench.batch_rows", settings.model, str(settings.data_dir)]
    command += ["--threads", str(settings.threads)]
    env = dict(os.environ)
    if setup.no_repack:
        command.append("--no-repack")
    if setup.no_tiled:
        env["GGML_CPU_TILED_MM"] = "0"
    if setup.site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(setup.site), env.get("PYTHONPATH", "")])
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    if setup.site is not None and not data["library"].startswith(str(setup.site)):
        raise RuntimeError(f"measured {data['library']}, not the wheel in {setup.site}")
    return Measured(data["prefill_tok_s"], [RowCost(**c) for c in data["costs"]])


def section(
    models: list[Settings], stock_site: Path | None, invariant_site: Path | None = None
) -> str:
    setups: dict[str, Setup] = {"row-invariant below 32 (make install)": Setup(None)}
    if stock_site is not None:
        setups["stock"] = Setup(stock_site)
    if invariant_site is not None:
        setups["batch-invariant"] = Setup(invariant_site, no_repack=True, no_tiled=True)
    rows, prefill = [], []
    for settings in models:
        measured = {name: _run(settings, setup) for name, setup in setups.items()}
        base = measured.get("stock") or next(iter(measured.values()))
        for name, result in measured.items():
            prefill.append(
                f"| {settings.model} | {name} | {result.prefill_tok_s:.0f} | "
                f"{result.prefill_tok_s / base.prefill_tok_s:.2f} |"
            )
            single = result.costs[0].pass_ms
            rows += [
                f"| {settings.model} | {name} | {c.rows} | {c.drift:.4f} | {c.pass_ms:.1f} | "
                f"{c.pass_ms / single:.2f} | {c.rows * single / c.pass_ms:.2f} |"
                for c in result.costs
            ]
    missing = "".join(
        f"\nThe {name} wheel was not given (`make {target}`): no rows for it.\n"
        for name, target, site in (
            ("stock", "wheel-stock", stock_site),
            ("batch-invariant", "wheel-invariant", invariant_site),
        )
        if site is None
    )
    return HEADER + "\n".join(rows) + "\n" + PREFILL_HEADER + "\n".join(prefill) + "\n" + missing


HEADER = f"""## Decoding rows in one batch: drift and cost

After a {PROMPT_TOKENS}-token prompt, the next tokens are decoded one at a time, then again as
one batch of n rows — the shape in which speculative decoding verifies a draft of n - 1 tokens
(and the Conclave decodes n streams). "Drift" is the largest logit difference between a row
computed in the batch and the same token decoded alone; where it is not 0, exact batching
decides a row again alone when its top two logits are closer than `TIE_MARGIN`
(worker/conclave/near_tie.py). "Pass" is the median time of one decode call of n rows with
logits for all of them. "Bound" is rows / (pass / one row): the speed-up of a draft of n - 1
tokens that is accepted whole, the most speculation can give at that length.

Three kernel setups (`bench/batch_rows.py`): **row-invariant below 32** is the wheel
`make install` builds: llama.cpp's kernels that change code path with the number of rows
start at 32 rows instead of 2, 4 and 8 (deploy/build-llama-wheel.sh patches the thresholds),
except llamafile's Q8_0, Q5_0 and Q4_0 kernels on AVX2, whose arithmetic per output is a lone
row's and which keep their 2; the one-row kernels of Q6_K, Q4_1 and repacked Q4_K take
several rows, unpacking each weight block once (deploy/llama-kquant-rows.patch); flash attention is tiled for every pass
(deploy/llama-flash-attn-tiles.patch). So a decode step of fewer rows computes each row as a
lone decode does while a 256-token prefill chunk keeps the fast kernels; **stock** is the sdist
unchanged (`make wheel-stock`), flash attention included;
**batch-invariant** is llama.cpp built without llamafile's sgemm and run without weight
repacking and without the tiled K-quant path (`make wheel-invariant`).

| model | kernels | rows | drift (max abs logit) | pass ms | pass / one row | bound |
|---|---|---|---|---|---|---|
"""

PREFILL_HEADER = """
Prefill of a 256-token chunk (median of 5), the same setups:

| model | kernels | prefill tok/s | vs stock |
|---|---|---|---|
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-repack", action="store_true")
    args = parser.parse_args()
    if args.no_repack:
        _without_repack()
    settings = Settings(model=args.model, data_dir=args.data_dir, n_threads=args.threads)
    print(json.dumps(asdict(measure(settings)) | {"library": llama_cpp.__file__}))


if __name__ == "__main__":
    main()
