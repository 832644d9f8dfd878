"""A model fingerprint: which cached KV states a process may read.

The state of a prompt depends on the weights, the KV cache's data type, the attention kernel
(flash attention rounds otherwise and lays V out untransposed), the kernels its chunks take and
the state format of the llama.cpp build, so all five go into the model's fingerprint (also the
result store's identity: what decides a request's output). The cache's namespace adds the CPU
features the llama.cpp backend was built for: `make install` builds it natively, and a host
with AVX-512 takes other code paths than one with AVX2 only, whose sums round otherwise. So a
different model, build or CPU kernel set reads none of another's blobs, even in a cache
directory hosts share. Hashing a GGUF takes ~1 s per 500 MB, so the content digest is kept in
a sidecar file keyed by path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib.metadata import version
from pathlib import Path

import llama_cpp
import orjson

from shared.models import resolve_model
from shared.settings import Settings

# llama.cpp's default KV cache type; granary does not change it.
KV_CACHE_TYPE = "f16"
# How a prompt chunk's passes are computed: with the sdist's row thresholds (worker/kernels.py).
# States granary cached before, when a chunk under 32 tokens was read one row at a time, hold
# other values, so they are not read.
PROMPT_KERNELS = "prompt-chunks=sdist-thresholds"
# With flash attention every pass is tiled, a K/V head's query rows in one tile, and a decode
# pass reads its cells in fixed segments (deploy/llama-flash-attn-tiles.patch); states and
# results cached before hold other values.
FLASH_ATTN = "flash-attn=tiled-every-pass,decode-in-segments"
_CHUNK_BYTES = 8 * 1024 * 1024


def file_digest(path: Path, sidecar_dir: Path) -> str:
    stat = path.stat()
    stamp = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    sidecar = sidecar_dir / "fingerprints.json"
    known = read_json(sidecar)
    if stamp in known:
        return str(known[stamp])
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    known[stamp] = digest.hexdigest()
    write_json(sidecar, known)
    return digest.hexdigest()


def model_fingerprint(path: Path, sidecar_dir: Path, *, flash_attn: bool) -> str:
    parts = [
        file_digest(path, sidecar_dir),
        KV_CACHE_TYPE,
        f"llama-cpp-python={version('llama-cpp-python')}",
        PROMPT_KERNELS,
    ]
    if flash_attn:  # off adds nothing: states cached before the setting keep their fingerprint
        parts.append(FLASH_ATTN)
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def configured_fingerprint(settings: Settings) -> str:
    """The fingerprint of the model and kernels these settings load, on any CPU."""
    path = resolve_model(settings.model, settings.data_dir)
    return model_fingerprint(path, settings.data_dir, flash_attn=settings.flash_attn)


def cpu_kernels() -> str:
    """The loaded CPU backend's features, as llama.cpp reports them ("CPU : SSE3 = 1 | ...")."""
    return str(llama_cpp.llama_print_system_info().decode()).strip()


def with_kernels(fingerprint: str, kernels: str) -> str:
    """A model's fingerprint bound to the CPU kernels that compute its cells (`cpu_kernels()`)."""
    return hashlib.blake2b(f"{fingerprint}|{kernels}".encode(), digest_size=12).hexdigest()


def cache_fingerprint(settings: Settings) -> str:
    """The namespace of the states this process computes and may read in the prefix cache."""
    return with_kernels(configured_fingerprint(settings), cpu_kernels())


def read_json(path: Path) -> dict[str, object]:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, object]) -> None:
    """Best effort, atomically: a lost sidecar only costs its work again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass
