"""Guessing the next tokens for free: n-gram lookup in the prompt and the output so far.

Extraction answers copy spans of their document and long outputs repeat themselves, so the
tokens that followed the last occurrence of the current n-gram are a good guess for what comes
next. The guess is only a draft: the model verifies it (worker/speculation/decoder.py).

The index is updated as tokens arrive (one dict write per n-gram length and token), so a
proposal costs a few dict lookups however long the sequence is, instead of a rescan per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class DraftSource(Protocol):
    """Something that proposes the tokens following the sequence it has been shown."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence: the prompt first, then each accepted output token."""
        ...

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow the sequence; [] when there is no guess."""
        ...


class NgramLookup:
    """Prompt lookup: continue the most recent earlier occurrence of the last n tokens.

    n runs from `max_n` down to `min_n`: a longer match is stronger evidence of a copied span.
    Only n-grams that something followed are indexed, so the sequence's own tail never matches
    itself. Once a proposal is followed, the next one continues the same span instead of
    matching again: in a document whose lines share short n-grams (every line of a ledger says
    "units of"), re-matching would jump to the latest such line in the middle of a quote.
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # One dict per n: n-gram -> position of the token that followed its latest occurrence.
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}
        # Position of the token the span being copied says comes next; None: not copying.
        self._cursor: int | None = None
        self.extend(list(tokens))

    @property
    def ngram_sizes(self) -> range:
        return range(self.max_n, self.min_n - 1, -1)

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.tokens
        for token in tokens:
            end = len(seq)
            self._follow(token, end)
            # The n-grams ending just before `token` now have a continuation.
            for n in self.ngram_sizes:
                if end >= n:
                    self._next[n][tuple(seq[end - n : end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        if self._cursor is None:
            self._cursor = self._match()
        return [] if self._cursor is None else continue_from(self.tokens, self._cursor, k)

    def _match(self) -> int | None:
        seq = self.tokens
        for n in self.ngram_sizes:
            if len(seq) >= n and (start := self._next[n].get(tuple(seq[-n:]))) is not None:
                return start
        return None

    def _follow(self, token: int, end: int) -> None:
        cursor = self._cursor
        if cursor is not None:
            self._cursor = cursor + 1 if cursor < end and self.tokens[cursor] == token else None


def continue_from(seq: Sequence[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `seq[start:]`, running on into the draft itself.

    A match close to the end means the text is looping with period len(seq) - start; copying
    past the end then repeats the loop instead of cutting the draft short.
    """
    draft: list[int] = []
    end = len(seq)
    for i in range(start, start + k):
        draft.append(seq[i] if i < end else draft[i - end])
    return draft


class FirstOf:
    """Several sources in order of trust: the first one with a guess wins.

    Every source sees every token, so a later source is ready when an earlier one has nothing.
    """

    def __init__(self, *sources: DraftSource) -> None:
        self.sources = sources

    def extend(self, tokens: Sequence[int]) -> None:
        for source in self.sources:
            source.extend(tokens)

    def propose(self, k: int) -> list[int]:
        for source in self.sources:
            draft = source.propose(k)
            if draft:
                return draft
        return []
