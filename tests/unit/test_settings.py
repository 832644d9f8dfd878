from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared.settings import load_settings


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.api.port == 8080
    assert settings.model == "smollm2-135m"
    assert settings.cache_dir == settings.data_dir / "kv"
    # A request meeting a frozen Redis waits this long for its 503 (issue 40: at most 3 s).
    assert settings.api.redis_timeout_s == 3.0


def test_env_beats_toml_beats_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "custom.toml"
    config.write_text('model = "from-toml"\nn_ctx = 2048\n[api]\nport = 9000\n')
    monkeypatch.setenv("GRANARY_N_CTX", "3000")
    monkeypatch.setenv("GRANARY_WORKER__HEARTBEAT_TTL_S", "7")
    settings = load_settings(config)
    assert settings.model == "from-toml"
    assert settings.n_ctx == 3000
    assert settings.api.port == 9000
    assert settings.worker.heartbeat_ttl_s == 7


def test_config_from_env_and_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    Path("granary.toml").write_text("n_batch = 64\n")
    assert load_settings().n_batch == 64
    other = tmp_path / "other.toml"
    other.write_text("n_batch = 32\n")
    monkeypatch.setenv("GRANARY_CONFIG", str(other))
    assert load_settings().n_batch == 32


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRANARY_API__PORT", "99999")
    with pytest.raises(ValidationError, match="port"):
        load_settings()
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.toml")


def test_the_deploy_example_config_loads() -> None:
    from tests.harness import REPO

    settings = load_settings(REPO / "deploy" / "granary.example.toml")
    assert settings.warmer.schedule == "0 3 * * *" and settings.warmer.catch_up


def test_workers_on_one_host_divide_its_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GRANARY_N_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert load_settings().threads == 8
    monkeypatch.setenv("GRANARY_WORKERS_PER_HOST", "3")
    assert load_settings().threads == 2
    monkeypatch.setenv("GRANARY_WORKERS_PER_HOST", "20")
    assert load_settings().threads == 1
    monkeypatch.setenv("GRANARY_N_THREADS", "5")
    assert load_settings().threads == 5
    monkeypatch.setenv("GRANARY_WORKERS_PER_HOST", "0")
    with pytest.raises(ValidationError):
        load_settings()
