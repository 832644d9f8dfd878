"""compose.yaml and the systemd units, checked by the real tools that read them.

`docker-compose` (Debian's, v1) parses compose.yaml without a Docker engine; `docker compose`
(v2) is checked too where its plugin is installed (no Debian package ships it). The units go
through `systemd-analyze verify`. `make test` installs the Debian tools when missing; a local
run without them skips, CI (CI=true) fails instead, so a green CI has really run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.settings import Settings, load_settings
from tests.harness import REPO, Stack, free_port

COMPOSE = REPO / "compose.yaml"
UNITS = sorted((REPO / "deploy").glob("*.service"))
# Where the units expect the install (README, "Deploying").
UNIT_GRANARY = "/opt/granary/.venv/bin/granary"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing on CI; `make test` installs it (target `tools`)")
        pytest.skip(f"{name} is not installed (`make tools` installs it)")
    return path


def _run_compose(argv: list[str], workers: str | None) -> str:
    """`argv config` on compose.yaml, with GRANARY_WORKERS set or not; the printed config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRANARY_")}
    if workers is not None:
        env["GRANARY_WORKERS"] = workers
    out = subprocess.run(
        [*argv, "-f", str(COMPOSE), "config"],
        env=env, cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def _compose_v1(workers: str | None) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(_run_compose([_tool("docker-compose")], workers))
    return config


def _compose_v2(workers: str | None) -> dict[str, Any]:
    docker = shutil.which("docker")
    plugin = docker and subprocess.run([docker, "compose", "version"], capture_output=True)
    if not plugin or plugin.returncode != 0:
        pytest.skip("the `docker compose` plugin is not installed (no Debian package ships it)")
    config: dict[str, Any] = yaml.safe_load(_run_compose([str(docker), "compose"], workers))
    return config


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target → named volume; v1 prints `source:target:mode`, v2 a mapping."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        mounts[target] = source
    return mounts


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(params=[_compose_v1, _compose_v2], ids=["docker-compose", "docker compose"])
def compose_config(request: pytest.FixtureRequest) -> Callable[[str | None], dict[str, Any]]:
    load: Callable[[str | None], dict[str, Any]] = request.param
    return load


def test_compose_redis_keeps_an_append_only_file_on_a_volume(
    compose_config: Callable[[str | None], dict[str, Any]],
) -> None:
    config = compose_config(None)
    redis = config["services"]["redis"]
    assert _flag(redis["command"], "--appendonly") == "yes"
    assert _flag(redis["command"], "--appendfsync") == "everysec"
    # The official image's working directory, where AOF files go, is a named volume.
    assert _mounts(redis)["/data"] in config["volumes"]


def test_compose_services_wait_for_a_healthy_redis(
    compose_config: Callable[[str | None], dict[str, Any]],
) -> None:
    services = compose_config(None)["services"]
    assert services["redis"]["healthcheck"]["test"]
    assert services["api"]["healthcheck"]["test"]
    for name in ("api", "worker", "warmer"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_compose_workers_divide_the_cores(
    compose_config: Callable[[str | None], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    default = compose_config(None)["services"]["worker"]
    assert int(default["deploy"]["replicas"]) == 1
    worker = compose_config("3")["services"]["worker"]
    assert int(worker["deploy"]["replicas"]) == 3
    # The environment compose gives a worker is a setting granary reads, and divides by.
    for key in [k for k in os.environ if k.startswith("GRANARY_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    for key, value in worker["environment"].items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(12)))
    assert load_settings().threads == 4


def test_compose_api_healthcheck_asks_a_real_api(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> None:
    """The healthcheck's own command, with this venv's Python: passes while the API serves."""
    test = _compose_v1(None)["services"]["api"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    command = [sys.executable, *test[2:]]
    port = free_port()
    env = {**os.environ, "GRANARY_API__PORT": str(port)}
    stack = Stack(settings_factory(api={"port": port}), tmp_path)
    stack.start_api()
    try:
        assert subprocess.run(command, env=env, capture_output=True).returncode == 0
    finally:
        stack.stop()
    assert subprocess.run(command, env=env, capture_output=True).returncode != 0


def test_systemd_units_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on copies whose ExecStart is this venv's real `granary`.

    verify refuses a unit whose command does not exist, and /opt/granary is not installed
    here; everything else in the copies is the shipped text. verify exits 0 on parse warnings
    (unknown keys, bad values), so any line it prints about a unit fails the test too.
    """
    analyze = _tool("systemd-analyze")
    granary = Path(sys.executable).parent / "granary"
    assert granary.is_file(), f"{granary} is missing: the venv has no granary command"
    assert {u.name for u in UNITS} == {
        "granary-api.service", "granary-warmer.service", "granary-worker@.service",
    }  # fmt: skip
    for unit in UNITS:
        text = unit.read_text()
        assert f"ExecStart={UNIT_GRANARY} " in text, unit.name
        (tmp_path / unit.name).write_text(text.replace(UNIT_GRANARY, str(granary)))
    names = [u.name.replace("@.", "@1.") for u in UNITS]  # the template as instance 1
    out = subprocess.run(
        [analyze, "verify", *(str(tmp_path / n) for n in names)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    printed = out.stdout + out.stderr
    assert out.returncode == 0, printed
    assert "granary" not in printed, printed


def test_the_distribution_is_not_named_like_pypis_granary() -> None:
    """PyPI's `granary` is an unrelated project: an install by that name could pick it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "granary-llm"
    assert "granary" in project["scripts"]
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert "--no-index --find-links /wheels /wheels/granary_llm-*.whl" in dockerfile


def test_the_image_and_make_build_llama_cpp_python_one_way() -> None:
    """Both run deploy/build-llama-wheel.sh, so an image's kernels are the ones tested here."""
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert "RUN deploy/build-llama-wheel.sh /wheels" in dockerfile
    assert "llama-cpp-python==" not in dockerfile  # no second build rule
    makefile = (REPO / "Makefile").read_text()
    assert "LLAMA_BUILD := deploy/build-llama-wheel.sh" in makefile
    assert "$(LLAMA_BUILD) $(LLAMA_WHEELS)" in makefile
