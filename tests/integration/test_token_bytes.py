"""Every token's text reaches the answer, however long its piece (real vocabularies)."""

from __future__ import annotations

import pytest

from shared.llm import detokenize, load_llama
from shared.settings import Settings
from tests.conftest import DATA_DIR

# Runs the vocabularies hold as single tokens longer than llama-cpp-python's 32-byte buffer.
TEXTS = ["x" + " " * 80 + "y", "=" * 120, "-" * 96 + "\n", "\n" + " " * 40 + "return x"]


@pytest.mark.parametrize(
    "model", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.qwen)]
)
def test_long_pieces_are_read_whole(model: str) -> None:
    llama = load_llama(Settings(model=model, data_dir=DATA_DIR), vocab_only=True)
    lengths = []
    for text in TEXTS:
        tokens = llama.tokenize(text.encode(), add_bos=False, special=False)
        assert detokenize(llama, tokens) == text.encode()
        lengths += [len(detokenize(llama, [t])) for t in tokens]
    assert max(lengths) > 32  # the case llama-cpp-python's detokenize reads as nothing
