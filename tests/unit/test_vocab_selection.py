"""Which tokens a trim keeps, on small byte-level BPE vocabularies built here (no model file)."""

from __future__ import annotations

from shared.vocab_trim.selection import (
    BPE,
    BYTE,
    NORMAL,
    SENTENCEPIECE,
    Vocabulary,
    byte_characters,
    ranking,
    select,
)

CONTROL = 3


def _bpe(merges: list[str], extra: list[str] = ()) -> Vocabulary:  # type: ignore[assignment]
    """Bytes, then one token per merge (in merge order), then `extra` control tokens."""
    tokens = sorted(byte_characters())
    for merge in merges:
        left, right = merge.split(" ")
        if left + right not in tokens:
            tokens.append(left + right)
    types = [NORMAL] * len(tokens) + [CONTROL] * len(extra)
    return Vocabulary(model=BPE, tokens=[*tokens, *extra], types=types, merges=merges)


def _kept_texts(vocab: Vocabulary, kept: list[int]) -> set[str]:
    return {vocab.tokens[i] for i in kept} - byte_characters()


def test_byte_characters_are_gpt2s_256() -> None:
    chars = byte_characters()
    assert len(chars) == 256
    assert {"a", "!", "Ġ", "Ċ", "ÿ"} <= chars  # Ġ is the space, Ċ the newline
    assert " " not in chars and "\n" not in chars


def test_every_byte_and_control_token_is_kept_at_any_size() -> None:
    vocab = _bpe(["a b", "ab c"], extra=["<|im_end|>"])
    selection = select(vocab, keep=1)
    kept = {vocab.tokens[i] for i in selection.kept}
    assert byte_characters() <= kept and "<|im_end|>" in kept
    assert len(selection.kept) == 257


def test_unused_tokens_may_go() -> None:
    vocab = _bpe(["a b"], extra=["[PAD1]"])
    unused = Vocabulary(BPE, vocab.tokens, [*vocab.types[:-1], 5], vocab.merges)
    assert "[PAD1]" not in {unused.tokens[i] for i in select(unused, keep=1).kept}


def test_a_kept_token_brings_the_inputs_of_every_merge_that_makes_it() -> None:
    # "abc" is made two ways; keeping it keeps both ways' inputs, so any word the full
    # tokenizer merges into "abc" is merged the same way by the trimmed one.
    merges = ["x y", "a b", "b c", "ab c", "a bc"]
    vocab = _bpe(merges)
    selection = select(vocab, keep=257, counts={vocab.tokens.index("abc"): 5})
    assert _kept_texts(vocab, selection.kept) == {"abc", "ab", "bc"}
    assert selection.merges == ["a b", "b c", "ab c", "a bc"]


def test_merges_survive_only_with_their_inputs_and_result_in_their_order() -> None:
    vocab = _bpe(["a b", "c d", "ab cd", "e f"])
    selection = select(vocab, keep=258)  # by merge rank: "ab", then "cd"
    assert _kept_texts(vocab, selection.kept) == {"ab", "cd"}
    assert selection.merges == ["a b", "c d"]  # "ab cd" would make a dropped token


def test_corpus_counts_rank_before_merge_rank() -> None:
    vocab = _bpe(["a b", "c d", "e f"])
    ef = vocab.tokens.index("ef")
    order = [
        vocab.tokens[i] for i in ranking(vocab, {ef: 3}) if vocab.tokens[i] in {"ab", "cd", "ef"}
    ]
    assert order == ["ef", "ab", "cd"]


def test_ids_stay_in_their_order_and_map_one_to_one() -> None:
    vocab = _bpe(["a b", "c d", "e f"], extra=["<|end|>"])
    selection = select(vocab, keep=258, also=[len(vocab.tokens) - 1])
    assert selection.kept == sorted(selection.kept)
    new = selection.new_ids()
    assert sorted(new.values()) == list(range(len(selection.kept)))
    assert new[len(vocab.tokens) - 1] == len(selection.kept) - 1


def test_sentencepiece_keeps_its_byte_tokens_and_ranks_by_score() -> None:
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁the", "▁rare", "▁and"]
    vocab = Vocabulary(
        model=SENTENCEPIECE,
        tokens=pieces,
        types=[BYTE] * 256 + [NORMAL] * 3,
        merges=[],
        scores=[0.0] * 256 + [-1.0, -9.0, -2.0],
    )
    selection = select(vocab, keep=258)
    assert {vocab.tokens[i] for i in selection.kept[256:]} == {"▁the", "▁and"}


def test_sentencepiece_keeps_a_kept_tokens_characters_and_pieces() -> None:
    # "." scores lowest (single characters do in Gemma's vocabulary); written as a byte token
    # it would tokenize otherwise, so a kept token holding it keeps it, with "▁a" on the way.
    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁a.", "▁a", ".", "▁", "a", "▁b"]
    vocab = Vocabulary(
        model=SENTENCEPIECE,
        tokens=pieces,
        types=[BYTE] * 256 + [NORMAL] * 6,
        merges=[],
        scores=[0.0] * 256 + [-1.0, -2.0, -99.0, -98.0, -97.0, -3.0],
    )
    selection = select(vocab, keep=258)
    assert {vocab.tokens[i] for i in selection.kept[256:]} == {"▁a.", "▁a", ".", "▁", "a"}
