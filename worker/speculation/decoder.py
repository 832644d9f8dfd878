"""Speculative decoding: verify a drafted continuation in one batched forward pass.

Decoding one token reads every weight once; decoding the pending token plus k drafted ones in
one batch reads them once too. On a small CPU the batch is far from free, though (each extra
row costs a sizeable share of a plain step: docs/BENCHMARKS.md, "Decoding rows in one batch"),
so a draft pays only where most of it is accepted. Rejected tokens' memory cells are dropped
again (worker/speculation/control.py decides whether and how far to draft).

The model computes logits only for the positions being verified (the Llama is created with
logits_all=False; nothing here touches the prompt's logits).

Greedy accepts a draft token while it equals the argmax of the logits computed for it; sampling
uses the Leviathan/Chen rule, which for a draft that is a single guessed token (a point mass)
accepts it with the target probability p(d) and on rejection samples from the target with d
removed, so tokens follow the target distribution exactly. The target distribution is the one
llama-cpp-python's sampler chain samples from (top-k, top-p, min-p, temperature).

llama.cpp's CPU kernels are not batch-invariant: a row computed in a batch of several differs
from the same token decoded alone (docs/BENCHMARKS.md measures the drift), so a greedy choice
between two nearly tied logits can flip. With a `tie_margin` (`worker.speculation_exact`),
greedy verification trusts a batched row only where its top two logits are at least that far
apart; at a closer call it recomputes, one token at a time as plain decoding does, every cell
since the last one computed that way, and takes that choice (worker/speculation/near_tie.py). Greedy
output is then plain decoding's wherever batching moves logits by less than half the margin.
With margin 0 (the worker's default), near ties are taken as the batch computed them: much
faster where drafts are accepted, but output may part from plain decoding at a near tie.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import Llama

from worker.decode_batch import fill_batch
from worker.speculation.near_tie import TIE_MARGIN, is_near_tie
from worker.speculation.sources import DraftSource

SEQ = 0
Logits = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampler settings; the defaults of top_k and min_p are Llama.generate's."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 40
    min_p: float = 0.05

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class SpeculationStats:
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    # Forward passes with a draft to verify, and without one.
    verify_passes: int = 0
    plain_steps: int = 0
    verify_s: float = 0.0
    plain_s: float = 0.0
    # Near ties decided alone (greedy only), and the cells recomputed one by one for them.
    tie_replays: int = 0
    replayed: int = 0
    # The planner's estimate: plain time per token over speculative time per token.
    speedup: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class StepPlanner(Protocol):
    """Chooses each step's draft length and learns from the outcome (the controller)."""

    def plan(self) -> int:
        """Tokens to draft for the next step; 0 decodes one token plainly."""
        ...

    def record(self, drafted: int, accepted: int, emitted: int, replayed: bool = False) -> None:
        """After a step; `replayed`: a near tie re-decoded batch-written cells alone."""
        ...

    def guessed(self, right: bool) -> None:
        """On a step planned without a draft: whether the source's guess of its token was right."""
        ...

    @property
    def speedup(self) -> float | None:
        """Plain time per token over speculative time per token, once both were measured."""
        ...


class FixedDraft:
    """Always draft up to `k` tokens."""

    def __init__(self, k: int) -> None:
        self.k = k

    def plan(self) -> int:
        return self.k

    def record(self, drafted: int, accepted: int, emitted: int, replayed: bool = False) -> None:
        pass

    def guessed(self, right: bool) -> None:
        pass

    @property
    def speedup(self) -> float | None:
        return None


def supports_speculation(llama: Llama) -> bool:
    """Whether rejected draft cells can be dropped from this context's memory.

    A recurrent state cannot be rewound. A sliding-window cache can be cut back by a few
    just-decoded cells: it only ever overwrites cells already outside the window of the
    position before the batch, and a cut never goes back past that position, so no cell a
    later token needs is lost. That rests on llama.cpp's cell reuse policy, so speculation on
    such models is only enabled where swa_full keeps every cell anyway (llama-cpp-python's
    default). Checked on Gemma-3 past its 512-token window (also with swa_full=False).
    """
    model = llama.model
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return False
    return llama_cpp.llama_model_n_swa(model) == 0 or bool(llama.context_params.swa_full)


@dataclass(frozen=True, slots=True)
class Distribution:
    """A sparse probability distribution over token ids."""

    ids: npt.NDArray[np.int64]
    probs: npt.NDArray[np.float64]

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0


def target_distribution(logits: Logits, sampling: Sampling) -> Distribution:
    """What llama.cpp's chain top-k -> top-p -> min-p -> temp -> dist samples from."""
    if sampling.temperature == 0.0:
        return Distribution(np.array([int(np.argmax(logits))]), np.ones(1))
    if sampling.temperature < 0:
        # llama-cpp-python: a negative temperature samples the raw softmax.
        values = logits.astype(np.float64)
        return Distribution(np.arange(values.size, dtype=np.int64), _softmax(values))
    ids = _top_k(logits, sampling.top_k)
    kept = logits[ids].astype(np.float64)
    probs = _softmax(kept)
    if sampling.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p, the token crossing it included.
        n = int(np.searchsorted(np.cumsum(probs), sampling.top_p)) + 1
        ids, kept = ids[:n], kept[:n]
    if sampling.min_p > 0.0:
        keep = kept >= kept[0] + np.log(sampling.min_p)
        keep[0] = True
        ids, kept = ids[keep], kept[keep]
    return Distribution(ids, _softmax(kept / sampling.temperature))


def _top_k(logits: Logits, k: int) -> npt.NDArray[np.int64]:
    """Ids of the k largest logits, largest first (all of them if k <= 0)."""
    everything = not 0 < k < logits.size
    part = np.arange(logits.size) if everything else np.argpartition(-logits, k - 1)[:k]
    # Stable sort: equal logits keep id order, as in a greedy argmax.
    return part[np.argsort(-logits[part], kind="stable")].astype(np.int64)


def _softmax(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    exp = np.exp(values - values.max())
    out: npt.NDArray[np.float64] = exp / exp.sum()
    return out


def sample(dist: Distribution, rng: np.random.Generator) -> int:
    return int(dist.ids[_pick(dist.probs, rng)])


def _pick(probs: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return min(index, probs.size - 1)


def accept_or_resample(
    dist: Distribution, draft: int, rng: np.random.Generator
) -> tuple[int, bool]:
    """Leviathan/Chen for a point-mass draft: (token to emit, whether it was the draft).

    Accept with probability min(1, p(d) / 1) = p(d). Otherwise sample from the residual
    max(0, p - q) normalised, which for q = point mass at d is p with d removed. Together:
    P(emit x) = p(d)·[x = d] + (1 - p(d))·p(x)[x != d] / (1 - p(d)) = p(x).
    """
    p_draft = dist.prob(draft)
    if rng.random() < p_draft:
        return draft, True
    residual = np.where(dist.ids == draft, 0.0, dist.probs)
    return int(dist.ids[_pick(residual, rng)]), False


class SpeculativeDecoder:
    """Yields the tokens following a prefilled prompt, like Llama.generate, with drafting.

    On entry the context's memory holds every prompt token but the last (llama.n_tokens of
    them); `last_token` is the one not yet decoded. Afterwards llama.n_tokens and
    llama.input_ids describe exactly the cells in memory, as after Llama.eval.
    """

    def __init__(
        self,
        llama: Llama,
        last_token: int,
        *,
        sampling: Sampling,
        source: DraftSource | None = None,
        planner: StepPlanner | None = None,
        seed: int | None = None,
        max_draft: int = 16,
        max_tokens: int | None = None,
        tie_margin: float = TIE_MARGIN,
    ) -> None:
        if source is not None and not supports_speculation(llama):
            source = None  # the memory could not drop rejected cells: decode plainly
        self.llama = llama
        self.sampling = sampling
        self.source = source
        self.planner: StepPlanner = planner if planner is not None else FixedDraft(max_draft)
        self.max_draft = max_draft
        self.max_tokens = max_tokens
        self.tie_margin = tie_margin
        self.stats = SpeculationStats()
        self._pending = last_token
        # Cells below this position were computed one token at a time, as plain decoding does.
        self._exact_until = llama.n_tokens
        self._rng = np.random.default_rng(seed)
        self._n_vocab = llama.n_vocab()
        self._batch: llama_cpp.llama_batch | None = llama_cpp.llama_batch_init(max_draft + 1, 0, 1)

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        batch, self._batch = getattr(self, "_batch", None), None
        if batch is not None:
            llama_cpp.llama_batch_free(batch)

    def __del__(self) -> None:
        self.close()

    def __iter__(self) -> Iterator[int]:
        # Stale cells past n_tokens (a previous job's tail) would be attended to: drop them,
        # as Llama.eval does before every decode (and, like it, whatever the memory answers).
        memory = llama_cpp.llama_get_memory(self.llama.ctx)
        llama_cpp.llama_memory_seq_rm(memory, SEQ, self.llama.n_tokens, -1)
        left = self.max_tokens
        while (left is None or left > 0) and self.llama.n_tokens < self.llama.n_ctx():
            emitted = self._step(left)
            if left is not None:
                emitted = emitted[:left]
                left -= len(emitted)
            yield from emitted

    def _step(self, left: int | None) -> list[int]:
        started = time.perf_counter()
        source = self.source
        # Without a source the planner is not consulted: it would time a step it did not plan.
        planned = 0 if source is None else self.planner.plan()
        draft = self._draft(planned, left)
        # A plain step still asks for a guess (no model work) so the planner sees when drafts
        # would start paying.
        guess = source.propose(1) if source is not None and planned == 0 else []
        replays = self.stats.tie_replays
        emitted, accepted = self._verify(draft)
        if source is not None:
            replayed = self.stats.tie_replays > replays
            self.planner.record(len(draft), accepted, len(emitted), replayed)
            if guess:
                self.planner.guessed(guess[0] == emitted[0])
            source.extend(emitted)
            self.stats.speedup = self.planner.speedup
        self._count(draft, accepted, len(emitted), time.perf_counter() - started)
        return emitted

    def _draft(self, k: int, left: int | None) -> list[int]:
        # A step emits the accepted drafts plus one token, all at positions below n_ctx.
        room = self.llama.n_ctx() - self.llama.n_tokens - 1
        limit = min(k, self.max_draft, room, room if left is None else left - 1)
        if limit <= 0 or self.source is None:
            return []
        return self.source.propose(limit)[:limit]

    def _verify(self, draft: list[int]) -> tuple[list[int], int]:
        """Decode pending + draft in one pass; returns (emitted tokens, drafts accepted)."""
        llama = self.llama
        start = llama.n_tokens
        seq = [self._pending, *draft]
        self._decode(seq, start)
        if self.sampling.greedy:
            emitted = self._accept_greedy(seq, start)
        else:
            emitted = self._accept_sampled(draft)
        accepted = len(emitted) - 1
        # Cells kept: the pending token and the accepted drafts; the rest were guesses.
        keep = 1 + accepted
        if keep < len(seq):
            self._memory_rm(start + keep)
        llama.input_ids[start : start + keep] = seq[:keep]
        llama.n_tokens = start + keep
        # The context's last logits may belong to a cut cell: Llama.generate must not sample
        # from them on an exact prompt match.
        llama._requires_eval = True
        self._pending = emitted[-1]
        return emitted, accepted

    def _accept_greedy(self, seq: list[int], start: int) -> list[int]:
        """Argmax per verified row while it equals the draft; a near tie is decided alone."""
        if len(seq) == 1 and self._exact_until == start:
            self._exact_until += 1  # a plain step computes its cell as plain decoding does
        # A lone row attending to batch-written cells is not plain decoding's row either.
        batched = len(seq) > 1 or self._exact_until < start
        emitted: list[int] = []
        for i in range(len(seq)):
            logits = self._logits(i)
            if batched and is_near_tie(logits, self.tie_margin):
                emitted.append(self._decide_alone(seq[: i + 1], start))
                break
            token = int(np.argmax(logits))
            emitted.append(token)
            if i == len(seq) - 1 or token != seq[i + 1]:
                break
        return emitted

    def _decide_alone(self, seq: list[int], start: int) -> int:
        """Greedy choice after seq[-1] as plain decoding makes it, cells replayed one by one.

        Cells written by batched passes hold slightly different values, so redoing the last
        row alone is not enough: every cell since the last one computed alone is recomputed.
        The cells after seq[-1] are dropped.
        """
        begin = self._exact_until
        replay = [*self.llama.input_ids[begin:start].tolist(), *seq]
        self._memory_rm(begin)
        for offset, token in enumerate(replay):
            self._decode([token], begin + offset)
        self._exact_until = start + len(seq)
        self.stats.tie_replays += 1
        self.stats.replayed += len(replay)
        return int(np.argmax(self._logits(0)))

    def _accept_sampled(self, draft: list[int]) -> list[int]:
        emitted: list[int] = []
        for i, guess in enumerate(draft):
            token, accepted = accept_or_resample(
                target_distribution(self._logits(i), self.sampling), guess, self._rng
            )
            emitted.append(token)
            if not accepted:
                return emitted
        dist = target_distribution(self._logits(len(draft)), self.sampling)
        emitted.append(sample(dist, self._rng))
        return emitted

    def _decode(self, seq: Sequence[int], start: int) -> None:
        batch = self._batch
        if batch is None:
            raise RuntimeError("SpeculativeDecoder is closed")
        # Logits for every verified position, and nowhere else.
        fill_batch(batch, [(token, start + i, SEQ) for i, token in enumerate(seq)], logits=True)
        status = llama_cpp.llama_decode(self.llama.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _logits(self, i: int) -> Logits:
        pointer = llama_cpp.llama_get_logits_ith(self.llama.ctx, i)
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))

    def _memory_rm(self, start: int) -> None:
        memory = llama_cpp.llama_get_memory(self.llama.ctx)
        if not llama_cpp.llama_memory_seq_rm(memory, SEQ, start, -1):
            raise RuntimeError("the context's memory cannot drop rejected draft cells")

    def _count(self, draft: list[int], accepted: int, emitted: int, elapsed: float) -> None:
        stats = self.stats
        stats.emitted += emitted
        if draft:
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.verify_passes += 1
            stats.verify_s += elapsed
        else:
            stats.plain_steps += 1
            stats.plain_s += elapsed
