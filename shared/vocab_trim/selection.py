"""Which tokens a trimmed vocabulary keeps, and which BPE merges survive: pure, no files.

A byte-level BPE tokenizer (GPT-2's scheme: Qwen, SmolLM2) builds every token by merging two
smaller ones, in the order of its merge list, starting from the 256 byte tokens. So:
- keeping every byte token keeps every text writable;
- a kept token is kept with the inputs of every merge that produces it (its ancestry), so the
  merges the full tokenizer applies on the way to a kept token are all still there;
- a merge survives when its two inputs and its result are all kept. The survivors keep their
  order, so a word whose full tokenization uses kept tokens only is merged by the same steps,
  in the same order: it tokenizes exactly as before (the test of "lossless").
A SentencePiece vocabulary (Gemma) has no merge list: its byte tokens (`<0x00>`...) are marked
BYTE and kept with its space piece, and tokens are ranked by their scores. It joins pieces by
score wherever the joined text is a token, so a kept token whose intermediate pieces went is
never produced: no closure is computed for it (the trim's round trip still checks every byte).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

from shared.errors import TrimRejected

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNUSED, BYTE = 1, 5, 6
BPE, SENTENCEPIECE = "gpt2", "llama"
SPACE = "\u2581"  # SentencePiece's word boundary


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """A GGUF's tokenizer fields: `model` is tokenizer.ggml.model, `merges` "left right" by rank."""

    model: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None = None


@dataclass(frozen=True, slots=True)
class Selection:
    """The kept tokens' old ids in ascending order (the new id of `kept[i]` is i) and merges."""

    kept: list[int]
    merges: list[str]

    def new_ids(self) -> dict[int, int]:
        return {old: new for new, old in enumerate(self.kept)}


@cache
def byte_characters() -> frozenset[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's printable remapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [256 + n for n in range(256 - len(printable))]
    unprintable = [b for b in range(256) if b not in printable]
    return frozenset(map(chr, printable + [shifted[unprintable.index(b)] for b in unprintable]))


def required_tokens(vocab: Vocabulary, also: Iterable[int] = ()) -> set[int]:
    """Tokens no trim may drop: every byte token, every special or control token, and `also`.

    Some BPE vocabularies lack a few byte tokens (SmolLM2 has none for bytes that never occur
    in UTF-8, such as 0xC0 or 0xFF): the full model cannot write those either.
    """
    if vocab.model == BPE:
        bytes_ = byte_characters()
        required = {i for i, text in enumerate(vocab.tokens) if text in bytes_}
    elif vocab.model == SENTENCEPIECE:
        # "▁" is its space: written as byte tokens it would read back as the character U+2581.
        required = {i for i, kind in enumerate(vocab.types) if kind == BYTE}
        required |= {i for i, text in enumerate(vocab.tokens) if text == SPACE}
    else:
        raise TrimRejected(f"cannot trim a {vocab.model!r} tokenizer (BPE or SentencePiece)")
    # Unused tokens (Qwen pads its vocabulary with 271) are the only other kind that may go.
    required |= {i for i, kind in enumerate(vocab.types) if kind not in (NORMAL, UNUSED)}
    return required | set(also)


def producers(vocab: Vocabulary) -> dict[int, list[tuple[int, int]]]:
    """For each token, the input pairs of the merges that produce it."""
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    made: dict[int, list[tuple[int, int]]] = {}
    for merge in vocab.merges:
        left, right = merge.split(" ", 1)
        result = ids.get(left + right)
        if result is not None and left in ids and right in ids:
            made.setdefault(result, []).append((ids[left], ids[right]))
    return made


def ranking(vocab: Vocabulary, counts: Mapping[int, int] | None = None) -> list[int]:
    """Tokens from most to least worth keeping: most used in `counts`, then by merge rank
    (BPE: a merge learnt earlier joins a more frequent pair) or score (SentencePiece)."""
    counts = counts or {}
    if vocab.model == BPE:
        rank: dict[int, float] = {}
        ids = {text: i for i, text in enumerate(vocab.tokens)}
        for r, merge in enumerate(vocab.merges):
            result = ids.get(merge.replace(" ", "", 1))
            if result is not None:
                rank.setdefault(result, r)
        # A normal token no merge makes is never produced: it ranks last.
        order = {i: rank.get(i, float("inf")) for i in range(len(vocab.tokens))}
    else:
        scores = vocab.scores or [0.0] * len(vocab.tokens)
        order = {i: -scores[i] for i in range(len(vocab.tokens))}
    return sorted(order, key=lambda i: (-counts.get(i, 0), order[i], i))


def select(
    vocab: Vocabulary,
    keep: int,
    *,
    also: Iterable[int] = (),
    counts: Mapping[int, int] | None = None,
) -> Selection:
    """The `keep` tokens to keep (more if the required ones and their ancestry need it)."""
    ancestry = _bpe_ancestry(vocab) if vocab.model == BPE else _sentencepiece_ancestry(vocab)
    kept: set[int] = set()

    def add(token: int) -> None:
        pending = [token]
        while pending:
            t = pending.pop()
            if t not in kept:
                kept.add(t)
                pending.extend(ancestry(t))

    for token in required_tokens(vocab, also):
        add(token)
    for token in ranking(vocab, counts):
        if len(kept) >= keep:
            break
        add(token)
    return Selection(kept=sorted(kept), merges=surviving_merges(vocab, kept))


def _bpe_ancestry(vocab: Vocabulary) -> Callable[[int], Iterable[int]]:
    """A BPE token's parents: the inputs of every merge that makes it."""
    made = producers(vocab)
    return lambda token: [i for pair in made.get(token, ()) for i in pair]


def _sentencepiece_ancestry(vocab: Vocabulary) -> Callable[[int], Iterable[int]]:
    """A SentencePiece token's pieces: its characters and the pieces they are joined through,
    the highest-scoring join first (the leftmost on a tie), as llama.cpp joins them."""
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    scores = vocab.scores or [0.0] * len(vocab.tokens)

    def pieces(token: int) -> list[int]:
        symbols, found = list(vocab.tokens[token]), []
        while len(symbols) > 1:
            joins = [
                (scores[ids[a + b]], -i)
                for i, (a, b) in enumerate(pairwise(symbols))
                if a + b in ids
            ]
            if not joins:
                break
            i = -max(joins)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            found.append(ids[symbols[i]])
        return [*found, *(ids[c] for c in vocab.tokens[token] if c in ids)]  # and its characters

    return pieces


def surviving_merges(vocab: Vocabulary, kept: set[int]) -> list[str]:
    """The merges whose inputs and result are all kept, in their order."""
    texts = {vocab.tokens[i] for i in kept}
    return [
        m
        for m in vocab.merges
        if (parts := m.split(" ", 1))[0] in texts
        and parts[1] in texts
        and parts[0] + parts[1] in texts
    ]
