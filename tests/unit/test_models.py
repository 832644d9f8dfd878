from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import ModelUnavailable
from shared.models import resolve_model


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
