"""Speculation inside shared steps: free drafts, and how many of them a pass should carry.

A stream with `speculation` `on` or `auto` may add draft rows to the turn's decode pass: the
tokens that followed the last occurrence of its current n-gram in its own prompt and output
(prompt lookup: extraction answers copy spans of their document, long outputs repeat
themselves). The pass computes every row as a lone decode would (the row-invariant kernels,
checked at start-up), so a draft accepted by the stream's own sampler is the token plain
decoding writes there, and greedy output with drafts equals output without.

How many drafts a pass carries is decided for the whole pass (`plan_drafts`): a draft row is
worth its cost only if the pass's tokens per second rise, and the cost of a pass grows with its
rows (measured here, `PassCost`; docs/BENCHMARKS.md, batch rows). So under
load, where the pass is already wide, drafting turns itself down, and it comes back when the
pass narrows. With a buffer per sequence llama.cpp computes a pass as several whenever its
streams bring different numbers of rows (`ubatch_rows`), each reading every weight again: one
stream's drafts beside plain rows cost a pass of their own, which the plan prices as such.
A stream's chance of accepting a draft (`Acceptance`) is learned on every step, drafting or
not (on a plain step the lookup's guess is scored against the token written), and apart for a
guess that starts a span and one that goes on after a right guess: a copied span mostly runs to
its end once begun, so one rate for both would price the eighth draft of a quote as if each
guess before it were a new start, and draft too little while copying.
Every pass stays below the row count from which the kernels take their batched path
(`granary_exact_rows`), so drafting never costs exactness.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["auto", "on", "off"]

# Drafts per stream and pass at most: a longer draft is rarely accepted whole.
MAX_DRAFT = 8
# N-gram lengths the lookup matches, longest first: a longer match is stronger evidence.
MIN_N, MAX_N = 2, 4
# Weight of the newest observation in the moving averages.
SMOOTHING = 0.1
# What a row more costs while a single row count was measured: this share of one row, a little
# below what batch rows measure on Qwen2.5 (docs/BENCHMARKS.md), so that a worker tries such a
# pass and measures it.
PRIOR_ROW_SHARE = 0.65
# A stream's acceptance before anything was observed: unknown text is free text.
PRIOR_ACCEPTANCE = 0.3


class PromptLookup:
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    Only n-grams that something followed are indexed, so the tail never matches itself. Once a
    proposal is followed, the next one continues the same span instead of matching again: in a
    document whose lines share short n-grams, re-matching would jump mid-quote to another line.
    """

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens: list[int] = []
        # One dict per n: n-gram -> position of the token that followed its latest occurrence.
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_N, MAX_N + 1)}
        # Position of the token the span being copied says comes next; None: not copying.
        self._cursor: int | None = None
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for token in tokens:
            end = len(seq)
            cursor = self._cursor
            if cursor is not None:
                self._cursor = cursor + 1 if cursor < end and seq[cursor] == token else None
            for n in self._next:
                if end >= n:
                    self._next[n][tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow; [] without a match."""
        if k <= 0:
            return []
        if self._cursor is None:
            self._cursor = self._match()
        if self._cursor is None:
            return []
        return _continue_from(self.tokens, self._cursor, k)

    def _match(self) -> int | None:
        seq = self.tokens
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(seq) >= n and (start := self._next[n].get(tuple(seq[-n:]))) is not None:
                return start
        return None


def _continue_from(seq: Sequence[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `seq[start:]`, running on into the draft itself: a match close to
    the end means the text loops with period len(seq) - start."""
    draft: list[int] = []
    end = len(seq)
    for i in range(start, start + k):
        draft.append(seq[i] if i < end else draft[i - end])
    return draft


class Acceptance:
    """Moving averages of whether guessed tokens were the ones written: `start`, a guess after
    a wrong one (or none), and `then`, a guess right after a right one."""

    def __init__(self, start: float = PRIOR_ACCEPTANCE, then: float = PRIOR_ACCEPTANCE) -> None:
        self.start = start
        self.then = then

    def observe(self, accepted: bool, after_right: bool) -> None:
        if after_right:
            self.then += SMOOTHING * (float(accepted) - self.then)
        else:
            self.start += SMOOTHING * (float(accepted) - self.start)

    def first(self, after_right: bool) -> float:
        """The chance the next guess is right."""
        return self.then if after_right else self.start


def ubatch_rows(counts: Sequence[int]) -> list[int]:
    """The rows of each pass llama.cpp splits a decode into, given each stream's rows in
    sequence order (one run of ids, memory.py): it takes the same number of rows from every
    stream of a run of consecutive ones that still has rows (`split_equal` in
    llama-batch.cpp), as many as the shortest of them has left."""
    left = list(counts)
    passes = []
    while any(left):
        first = next(i for i, n in enumerate(left) if n)
        run = list(itertools.takewhile(lambda i: left[i] > 0, range(first, len(left))))
        taken = min(left[i] for i in run)
        for i in run:
            left[i] -= taken
        passes.append(taken * len(run))
    return passes


class PassCost:
    """Seconds a decode pass of r rows takes, a moving average per row count; a count never
    measured is extrapolated from the nearest one below that was, at the cost per row between
    the two largest counts measured below it: rows cost most in the first few and far less
    after (docs/BENCHMARKS.md, batch rows: on SmolLM2 a second row costs about half a row,
    each past the fourth about a quarter), so a fixed share priced a long draft at twice its
    cost, and it was never tried, nor measured.
    Only passes llama.cpp computes as one are recorded (`ubatch_rows`)."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, rows: int, seconds: float) -> None:
        known = self._seconds.get(rows)
        self._seconds[rows] = seconds if known is None else known + SMOOTHING * (seconds - known)

    def estimate(self, rows: int) -> float | None:
        if rows in self._seconds:
            return self._seconds[rows]
        below = sorted(r for r in self._seconds if r < rows)
        if not below:
            return None
        top = below[-1]
        return self._seconds[top] + self._row_seconds(below) * (rows - top)

    def _row_seconds(self, below: list[int]) -> float:
        """What a row more costs past the largest of `below` (measured counts, ascending)."""
        if len(below) > 1:
            low, top = below[-2], below[-1]
            return max(0.0, (self._seconds[top] - self._seconds[low]) / (top - low))
        top = below[0]
        return PRIOR_ROW_SHARE * self._seconds[top] / (1 + PRIOR_ROW_SHARE * (top - 1))


class StreamDrafts:
    """One stream's drafting: its lookup, how often its guesses come true, what it drafted."""

    def __init__(self, mode: Mode, tokens: Sequence[int], worker: Acceptance) -> None:
        """`worker`: the acceptance of every stream so far, which this one starts from (an
        extraction's short answers end before a rate of their own would be learned) and
        keeps up to date; never above the prior: the streams before may have copied where
        this one writes free text (an essay after clause quotes drafted at their rate, and
        lost), and a stream that copies raises its own rate within a few tokens."""
        self.mode = mode
        self.lookup = PromptLookup(tokens)
        self.acceptance = Acceptance(
            min(worker.start, PRIOR_ACCEPTANCE), min(worker.then, PRIOR_ACCEPTANCE)
        )
        self._worker = worker
        self.drafted = 0  # draft rows its passes carried
        self.accepted = 0  # of which it wrote the token
        self._proposal: list[int] = []
        self._right = False  # whether its last scored guess was right

    def offer(self, key: int, room: int) -> Offer | None:
        """What this stream could add to the next pass (up to `room` rows), if anything."""
        self._proposal = self.lookup.propose(min(MAX_DRAFT, room))
        if not self._proposal:
            self._right = False  # whatever comes next starts a span
            return None
        first = self.acceptance.first(self._right)
        return Offer(key, self.mode, first, self.acceptance.then, len(self._proposal))

    def take(self, k: int) -> list[int]:
        """The first `k` tokens of the last offer, as this pass's draft rows."""
        draft = self._proposal[:k]
        self.drafted += len(draft)
        return draft

    def scored(self, draft: Sequence[int], accepted: int, written: int) -> None:
        """After the pass: the first `accepted` of `draft` were written (`accepted` counts
        them as they are); `written` is the token sampled after them, scored against the
        offer's next guess (a pass without drafts: its first)."""
        for _ in range(min(accepted, len(draft))):
            self._observe(True)
        if accepted < len(draft):
            self._observe(False)
        elif accepted < len(self._proposal):
            self._observe(self._proposal[accepted] == written)
        self._proposal = []

    def _observe(self, accepted: bool) -> None:
        self.acceptance.observe(accepted, self._right)
        self._worker.observe(accepted, self._right)
        self._right = accepted


@dataclass(frozen=True, slots=True)
class Offer:
    """A stream's drafts for this pass: its mode, the chance its first draft is right and
    that each right one is followed by another, and how many it has."""

    key: int
    mode: Mode
    first: float
    then: float
    available: int

    def expected(self, position: int) -> float:
        """The chance drafts 1 to `position` are all right: the tokens the last of them yields."""
        return self.first * self.then ** (position - 1)


def plan_drafts(
    keys: Sequence[int],
    offers: Sequence[Offer],
    cost: Callable[[int], float | None],
    max_rows: int,
) -> dict[int, int]:
    """How many drafts each offer puts in a pass of one plain row per stream of `keys` (in
    sequence order); `cost`: seconds of a pass llama.cpp computes as one, by its rows.

    `on` streams draft all they have; `auto` drafts are added, likeliest first, as far as the
    expected tokens per second of the whole pass gain by them (`Offer.expected`), the pass
    priced as the passes llama.cpp splits it into. Never more than `max_rows` rows in all.
    """
    rows = len(keys)
    room = max_rows - rows
    planned = {offer.key: 0 for offer in offers}
    for offer in offers:
        if offer.mode == "on":
            planned[offer.key] = take = max(0, min(offer.available, room))
            room -= take
    tokens = rows + sum(
        offer.expected(i)
        for offer in offers
        for i in range(1, planned[offer.key] + 1)
        if offer.mode == "on"
    )
    # The auto drafts in the order their expected tokens fall: within a stream that is its order.
    candidates = sorted(
        (
            (offer.expected(i), offer.key)
            for offer in offers
            if offer.mode == "auto"
            for i in range(1, min(offer.available, MAX_DRAFT) + 1)
        ),
        reverse=True,
    )[: max(0, room)]
    trial = dict(planned)
    best_rate, best_n = _rate(tokens, _pass_seconds(keys, trial, cost)), 0
    gained = tokens
    for n, (expected, key) in enumerate(candidates, start=1):
        gained += expected
        trial[key] += 1
        rate = _rate(gained, _pass_seconds(keys, trial, cost))
        if rate > best_rate:
            best_rate, best_n = rate, n
    for _expected, key in candidates[:best_n]:
        planned[key] += 1
    return planned


def _pass_seconds(
    keys: Sequence[int], drafts: dict[int, int], cost: Callable[[int], float | None]
) -> float | None:
    """What a pass with these drafts costs: the passes llama.cpp splits it into, summed."""
    total = 0.0
    for rows in ubatch_rows([1 + drafts.get(key, 0) for key in keys]):
        seconds = cost(rows)
        if seconds is None:
            return None
        total += seconds
    return total


def _rate(tokens: float, seconds: float | None) -> float:
    if seconds is None or seconds <= 0:
        return 0.0
    return tokens / seconds
