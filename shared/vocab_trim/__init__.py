"""`granary model trim`: a copy of a GGUF model whose vocabulary holds fewer tokens.

A decode step multiplies the last hidden state by one output row per token; on a small model
that matrix is a large share of the weights each step reads (Qwen2.5-0.5B has 151,936 rows),
and every step hands one logit per token to Python. Dropping tokens no text here uses makes
both smaller.
`selection` decides what stays, `gguf_file` writes the copy, and this module checks it before
it is kept: a held-out corpus (shipped, plus the user's) must tokenize and detokenize byte for
byte with the trimmed vocabulary, or nothing is written.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gguf import GGUFReader
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from shared.errors import TrimRejected
from shared.llm import detokenize, quiet_native_logs, token_bytes
from shared.vocab_trim.gguf_file import read_vocabulary, special_ids, write_trimmed
from shared.vocab_trim.selection import select

__all__ = ["TrimReport", "heldout_texts", "trim_model", "trimmed_path"]


@dataclass(frozen=True, slots=True)
class TrimReport:
    target: Path
    tokens_kept: int
    tokens_before: int
    merges_kept: int
    merges_before: int
    heldout_tokens_full: int
    heldout_tokens_trimmed: int
    seconds: float

    @property
    def overhead(self) -> float:
        """How many more tokens the held-out texts take with the trimmed vocabulary (0.02: 2%)."""
        return self.heldout_tokens_trimmed / self.heldout_tokens_full - 1


def trimmed_path(source: Path, keep: int, directory: Path | None = None) -> Path:
    """Where the trim of `source` to `keep` tokens is written (beside it unless `directory`)."""
    size = f"{keep // 1000}k" if keep % 1000 == 0 else str(keep)
    return (directory or source.parent) / f"{source.stem}.vocab-{size}.gguf"


def heldout_texts() -> list[str]:
    """Text no ranking reads: the shipped multilingual sample and characters U+0001 to U+00FF."""
    sample = resources.files("shared.vocab_trim").joinpath("heldout.txt").read_text("utf-8")
    return [*sample.splitlines(keepends=True), "".join(map(chr, range(1, 256)))]


def trim_model(source: Path, target: Path, keep: int, corpus: Sequence[str] = ()) -> TrimReport:
    """Write `source` with its `keep` most useful tokens to `target`, checked, or raise.

    Useful means used by `corpus` (counted with the full vocabulary), then by merge rank.
    The corpus must write back byte for byte too; the overhead reported is the held-out text's.
    """
    started = time.perf_counter()
    reader = GGUFReader(source)
    vocab = read_vocabulary(reader)
    if keep >= len(vocab.tokens):
        raise TrimRejected(f"the model has {len(vocab.tokens)} tokens; --keep must be fewer")
    full = _vocab_only(source)
    counts = Counter(t for text in corpus for t in _tokens(full, text))
    also = {*special_ids(reader).values(), *template_tokens(full)}
    selection = select(vocab, keep, also=also, counts=counts)
    partial = target.with_name(f".{target.name}.partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_trimmed(reader, selection, partial, {"source": source.name, "kept": str(keep)})
        trimmed = _vocab_only(partial)
        _check_round_trip(full, trimmed, corpus)
        full_count, trimmed_count = _check_round_trip(full, trimmed, heldout_texts())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return TrimReport(
        target=target,
        tokens_kept=len(selection.kept),
        tokens_before=len(vocab.tokens),
        merges_kept=len(selection.merges),
        merges_before=len(vocab.merges),
        heldout_tokens_full=full_count,
        heldout_tokens_trimmed=trimmed_count,
        seconds=time.perf_counter() - started,
    )


def template_tokens(llama: Llama) -> set[int]:
    """Every token the chat template writes around messages (markers, role names, newlines)."""
    template = llama.metadata.get("tokenizer.chat_template")
    if not template:
        return set()
    eos, bos = (
        token_bytes(llama, token, special=True).decode() if token >= 0 else ""
        for token in (llama.token_eos(), llama.token_bos())
    )
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    conversations = [
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
        [
            {"role": "system", "content": ""},
            {"role": "user", "content": ""},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": ""},
        ],
    ]
    rendered = (formatter(messages=c).prompt for c in conversations)  # type: ignore[arg-type]
    return {t for text in rendered for t in llama.tokenize(text.encode(), False, special=True)}


def _check_round_trip(full: Llama, trimmed: Llama, texts: Iterable[str]) -> tuple[int, int]:
    """Token counts of `texts` (full, trimmed); raises if the trimmed vocabulary loses a byte."""
    full_count = trimmed_count = 0
    for text in texts:
        tokens, full_tokens = _tokens(trimmed, text), _tokens(full, text)
        # The reference is the full vocabulary's own round trip: SentencePiece, for one, adds
        # and removes a leading space itself.
        if detokenize(trimmed, tokens) != detokenize(full, full_tokens):
            raise TrimRejected(f"the trimmed vocabulary does not write back {text[:60]!r}")
        full_count += len(full_tokens)
        trimmed_count += len(tokens)
    return full_count, trimmed_count


def _tokens(llama: Llama, text: str) -> list[int]:
    return llama.tokenize(text.encode(), add_bos=False, special=False)


def _vocab_only(path: Path) -> Llama:
    with quiet_native_logs():
        return Llama(model_path=str(path), vocab_only=True, verbose=False)
