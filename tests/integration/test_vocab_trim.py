"""`granary model trim` on real models: what it writes loads, writes every text back, keeps the
full model's logits on kept tokens, and serves chats as a model of its own."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGUFReader
from llama_cpp import Llama
from openai import OpenAI

from shared.llm import detokenize, quiet_native_logs
from shared.models import resolve_model
from shared.prefix_cache.fingerprint import cache_fingerprint
from shared.settings import Settings
from shared.vocab_trim import heldout_texts, trim_model
from shared.vocab_trim.gguf_file import read_vocabulary, special_ids
from shared.vocab_trim.selection import byte_characters
from tests.conftest import DATA_DIR
from tests.harness import REPO, Stack, settings_env

# Sizes small enough to drop most of each vocabulary (SmolLM2 49,152, Qwen 151,936 tokens).
KEEP = {"smollm2-135m": 16000, "qwen2.5-coder-0.5b": 32000}
MODELS = [
    "smollm2-135m",
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.qwen),
]
# A warm spec's document in words SmolLM2's merge ranks put late (German compounds).
SPEC_DOCUMENT = (
    "Die Gewährleistungsansprüche verjähren nach vierundzwanzig Monaten. "
    "Rücksendungen gehen an das Zentrallager in Mönchengladbach.\n"
)
# Prompts whose every token the trimmed vocabulary keeps (common English words).
PROMPTS = [
    "The delivery is free for orders above 79 dollars. Returns are accepted within 30 days.",
    "def add(a, b):\n    return a + b\n\n# Add two numbers and print the",
]


@dataclass(frozen=True)
class Trimmed:
    full_path: Path
    path: Path
    # The full model is read through llama.cpp: the gguf package takes ~6 s to open Qwen's.
    full: Llama
    trimmed: GGUFReader

    def full_tokens(self) -> list[str]:
        vocab = llama_cpp.llama_model_get_vocab(self.full.model)
        return [
            llama_cpp.llama_vocab_get_text(vocab, i).decode() for i in range(self.full.n_vocab())
        ]

    def full_special_ids(self) -> dict[str, int]:
        ids = {k: int(v) for k, v in self.full.metadata.items() if k.endswith("_token_id")}
        return {k: v for k, v in ids.items() if v >= 0}

    def kept_ids(self) -> np.ndarray:
        """The full model's id of each trimmed token, in the trimmed model's order."""
        index = {text: i for i, text in enumerate(self.full_tokens())}
        return np.array([index[t] for t in read_vocabulary(self.trimmed).tokens])


_trims: dict[str, Trimmed] = {}


@pytest.fixture(scope="module", params=MODELS)
def trimmed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trimmed:
    return _trimmed(str(request.param), tmp_path_factory)


def _trimmed(model: str, tmp_path_factory: pytest.TempPathFactory) -> Trimmed:
    """A model and its trim, made once per session; SmolLM2's through the command."""
    if model in _trims:
        return _trims[model]
    full = resolve_model(model, DATA_DIR)
    target = tmp_path_factory.mktemp("trim") / f"{model}.gguf"
    if model == "smollm2-135m":  # as a user trims, for the documents their warm specs name
        specs = tmp_path_factory.mktemp("specs")
        (specs / "contracts.txt").write_text(SPEC_DOCUMENT)
        (specs / "contracts.toml").write_text(f'documents = ["{specs}/*.txt"]\n')
        env = settings_env(Settings(data_dir=DATA_DIR, warmer={"spec_dir": specs}))
        command = ["model", "trim", model, "--keep", str(KEEP[model]), "--warm-specs"]
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", *command, "-o", str(target)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stdout.splitlines()[-1] == str(target)
        assert "written back byte for byte" in done.stderr
    else:
        trim_model(full, target, KEEP[model])
    _trims[model] = Trimmed(full, target, _vocab_only(full), GGUFReader(target))
    return _trims[model]


def _vocab_only(path: Path) -> Llama:
    with quiet_native_logs():
        return Llama(model_path=str(path), vocab_only=True, verbose=False)


def _round_trip_corpus() -> list[str]:
    exam = sorted((REPO / "bench" / "exam_docs").glob("*.*"))
    documents = [p.read_text("utf-8") for p in exam if p.suffix in (".html", ".txt", ".md")]
    code = (REPO / "shared" / "vocab_trim" / "selection.py").read_text("utf-8")
    emoji = "👩‍👩‍👧‍👦 🏳️‍🌈 🇰🇷 🫠 ⌘ \U0001d518\U0001d52b\U0001d526 ﷺ \u200b\u00ad a\u0301"
    return [*documents, code, emoji, "".join(map(chr, range(1, 256)))]


def test_every_text_is_written_back_byte_for_byte(trimmed: Trimmed) -> None:
    full, trim = trimmed.full, _vocab_only(trimmed.path)
    assert trim.n_vocab() < full.n_vocab() // 3
    # SmolLM2 has no token for a few bytes (0x04, 0xC0, 0xFF, …): neither model writes those.
    every_byte = byte_characters() <= set(trimmed.full_tokens())
    for text in [*_round_trip_corpus(), *heldout_texts()]:
        tokens = trim.tokenize(text.encode(), add_bos=False, special=False)
        expected = detokenize(full, full.tokenize(text.encode(), add_bos=False, special=False))
        assert detokenize(trim, tokens) == expected, text[:40]
        assert expected == text.encode() or not every_byte


def test_merges_are_closed_and_special_ids_name_the_same_tokens(trimmed: Trimmed) -> None:
    vocab = read_vocabulary(trimmed.trimmed)
    tokens = set(vocab.tokens)
    for merge in vocab.merges:  # no kept merge makes, or needs, a dropped token
        left, right = merge.split(" ")
        assert {left, right, left + right} <= tokens, merge
    full_tokens = trimmed.full_tokens()
    remapped = {k: vocab.tokens[i] for k, i in special_ids(trimmed.trimmed).items()}
    assert remapped == {k: full_tokens[i] for k, i in trimmed.full_special_ids().items()}
    rows = {
        t.name: t.data.shape[0]
        for t in trimmed.trimmed.tensors
        if t.name.startswith(("token_embd", "output."))
    }
    assert set(rows.values()) == {len(vocab.tokens)}, rows


def _last_logits(llama: Llama) -> np.ndarray:
    pointer = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llama.n_vocab(),)).copy()


def test_kept_tokens_have_the_full_models_logits_and_greedy_text(trimmed: Trimmed) -> None:
    threads = Settings().threads  # the cores this process may use
    with quiet_native_logs():
        full, trim = (
            Llama(
                model_path=str(p),
                n_ctx=256,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            for p in (trimmed.full_path, trimmed.path)
        )
    kept = trimmed.kept_ids()
    for prompt in PROMPTS:
        tokens = full.tokenize(prompt.encode(), add_bos=False)
        assert [int(kept[t]) for t in trim.tokenize(prompt.encode(), add_bos=False)] == tokens
        full.reset()
        trim.reset()
        full.eval(tokens)
        trim.eval([int(np.searchsorted(kept, t)) for t in tokens])
        for step in range(12):  # noqa: B007 (read after the loop: how far greedy agreed)
            whole, part = _last_logits(full), _last_logits(trim)
            assert np.array_equal(whole[kept], part)  # bit for bit, not close
            choice = int(np.argmax(whole))
            if choice not in kept:  # the one case where greedy text may differ
                break
            assert int(kept[np.argmax(part)]) == choice
            full.eval([choice])
            trim.eval([int(np.argmax(part))])
        assert step >= 6, f"the full model chose a dropped token after {step}: pick another prompt"


def test_a_trimmed_model_serves_chats_as_a_model_of_its_own(
    stack_factory: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Same answer as the full model, ended at the remapped end marker, under its own id and
    cache fingerprint (neither model reads the other's cached states)."""
    replies, fingerprints = [], set()
    trim = _trimmed("smollm2-135m", tmp_path_factory)
    for path in (trim.full_path, trim.path):
        stack = stack_factory(model=str(path))
        client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [str(path)]
        reply = client.chat.completions.create(
            model=str(path),
            messages=[{"role": "user", "content": "What is the capital of France? One word."}],
            max_tokens=32,
            temperature=0,
        )
        replies.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        fingerprints.add(cache_fingerprint(stack.settings))
    assert replies[0] == replies[1]
    assert replies[0][1] == "stop"
    assert len(fingerprints) == 2


def test_warm_spec_documents_keep_their_tokens(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The trim made with --warm-specs reads its spec's document in the full model's tokens;
    the same size trimmed by merge rank alone needs more."""
    trim = _trimmed("smollm2-135m", tmp_path_factory)
    plain = trim_model(trim.full_path, trim.path.with_name("plain.gguf"), KEEP["smollm2-135m"])
    counts = [
        len(_vocab_only(path).tokenize(SPEC_DOCUMENT.encode(), add_bos=False, special=False))
        for path in (trim.full_path, trim.path, plain.target)
    ]
    assert counts[0] == counts[1] < counts[2]
