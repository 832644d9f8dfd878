"""Which cached states a process may read: the fingerprint names everything that moves a cell."""

from __future__ import annotations

from pathlib import Path

from shared.prefix_cache.fingerprint import cpu_kernels, model_fingerprint, with_kernels

AVX2 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | REPACK = 1 |"
AVX512 = AVX2.replace("AVX2 = 1 |", "AVX2 = 1 | AVX512 = 1 |")


def test_weights_and_attention_kernel_name_the_model(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights")
    base = model_fingerprint(model, tmp_path, flash_attn=False)
    assert model_fingerprint(model, tmp_path, flash_attn=False) == base
    assert model_fingerprint(model, tmp_path, flash_attn=True) != base
    model.write_bytes(b"other weights")
    assert model_fingerprint(model, tmp_path, flash_attn=False) != base


def test_another_cpu_kernel_set_reads_none_of_the_states() -> None:
    # A cache directory shared by an AVX-512 host and an AVX2 host holds two sets of states.
    assert with_kernels("model", AVX2) == with_kernels("model", AVX2)
    assert with_kernels("model", AVX2) != with_kernels("model", AVX512)
    assert with_kernels("model", AVX2) != with_kernels("other", AVX2)


def test_the_kernel_set_is_the_loaded_backends() -> None:
    kernels = cpu_kernels()
    assert kernels.startswith("CPU :") and "= 1" in kernels, kernels
