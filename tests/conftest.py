"""Fixtures: a real Redis, real processes (API, workers) and the real SmolLM2 model.

`make test` runs the suite in two processes (pytest-xdist), each pinned to its own share of the
cores: a model's threads spin while they wait for each other, so two processes whose models
shared a core would slow each other down many times over, while pinned, each model reads on its
own core and one process's waits (a frozen Redis, a heartbeat's TTL, a process starting) are the
other's time to compute. Tests marked `all_cores` (the kernels split among threads) run after,
alone, on every core.

Redis: under pytest-xdist a private server per process, so the two never share a database, a
worker list or a pub/sub channel. Otherwise the server named by GRANARY_TEST_REDIS (e.g.
redis://127.0.0.1:6390, for suites run side by side), else 127.0.0.1:6379 when it answers (this
machine kind runs one), else a private server started here. Each test stack gets its own Redis
database, so stacks never see each other's jobs or workers.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import redis

from shared.models import MODEL_ALIASES, NAMED_MODELS, NamedModel
from shared.redis_server import answers, private_redis
from shared.settings import DEFAULT_REDIS_URL, Settings
from tests.harness import REPO, Stack, free_port
from tests.redis_process import RedisProcess

# Persistent across runs (git-ignored): assembled models are reused.
DATA_DIR = REPO / ".data" / "test"
# Database 0 is left to whatever else uses this Redis; 1-13 go to tests in turn, 14-15 to
# stacks a module's tests share, so a test's flush never empties a shared stack's database.
_databases = itertools.count()
_module_databases = itertools.count()

# What each test model can do: a test marked `needs(trait)` is generated only for the models
# that can (a parametrised model without it is deselected, not skipped).
MODEL_TRAITS = {
    "smollm2-135m": {"chat_template", "deltas"},
    "qwen2.5-coder-0.5b": {"chat_template", "deltas"},
    "gemma3-270m": set(),  # no chat template; a sliding window, so no deltas
}
# The marker a test that loads the model carries, so `-m "not qwen"` loads no Qwen.
MODEL_MARKERS = {"qwen2.5-coder-0.5b": "qwen", "gemma3-270m": "gemma"}
_running: list[pytest.Item] = []


def _xdist_share() -> tuple[int, int] | None:
    """This process's index among pytest-xdist's and their count; None when run without it."""
    name = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if name is None:
        return None
    return int(name.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])


def pytest_configure(config: pytest.Config) -> None:
    share = _xdist_share()
    if share is not None:
        # Children (APIs, workers, Redis) inherit the pinning; a worker's threads follow it.
        index, count = share
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[index::count] or [cores[index % len(cores)]])


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadscope` as `make test` runs it: a module with module-scoped fixtures runs
    whole in one process (its shared stack or models start once), every other test wherever a
    core is free; the largest modules go first and single tests fill the end. (pytest-xdist's
    own groups, `--dist loadgroup`, are not read under pytest 9.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedModulesThenTests(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return module if _has_module_fixtures(module) else nodeid

    return SharedModulesThenTests(config, log)


@functools.cache
def _has_module_fixtures(module: str) -> bool:
    """Read from the source: tests are independent, so a module missed here only starts its
    shared fixtures once more, in the other process."""
    return 'scope="module"' in (REPO / module).read_text()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, deselected = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        models = [value for value in params if isinstance(value, str) and value in MODEL_TRAITS]
        needs = {trait for marker in item.iter_markers("needs") for trait in marker.args}
        for model in models:
            if model in MODEL_MARKERS:
                item.add_marker(MODEL_MARKERS[model])
        if all(needs <= MODEL_TRAITS[model] for model in models):
            kept.append(item)
        else:
            deselected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _running[:] = [item]  # before its fixtures, module-scoped ones included, are set up
    yield


def require_model_marker(model: str) -> None:
    """Fails the running test if it loads a model whose marker it does not carry."""
    marker = MODEL_MARKERS.get(MODEL_ALIASES.get(model, model))
    if marker is None or not _running or _running[0].get_closest_marker(marker) is not None:
        return
    pytest.fail(f"{_running[0].nodeid} loads {model} without @pytest.mark.{marker}", False)


def _checked(named: NamedModel) -> NamedModel:
    def locate(models_dir: Path) -> Path:
        require_model_marker(named.name)
        return named.locate(models_dir)

    return NamedModel(named.name, named.install_hint, locate)


# In this process every named model is looked up through the check; stacks check their own.
NAMED_MODELS.update({name: _checked(named) for name, named in NAMED_MODELS.items()})


@pytest.fixture(scope="session")
def redis_base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    alone = _xdist_share() is None  # else this process's own server, below
    if alone and os.environ.get("GRANARY_TEST_REDIS"):
        yield os.environ["GRANARY_TEST_REDIS"]
        return
    if alone and answers(DEFAULT_REDIS_URL):
        yield "redis://127.0.0.1:6379"
        return
    # Throwaway: every test empties its database anyway, so nothing is worth an fsync.
    with private_redis(tmp_path_factory.mktemp("redis"), persistent=False) as url:
        yield url


def _db_url(base: str, db: int) -> str:
    return f"{base}?db={db}" if base.startswith("unix://") else f"{base}/{db}"


@pytest.fixture
def redis_url(redis_base_url: str) -> Iterator[str]:
    """A fresh, empty database for one test."""
    url = _db_url(redis_base_url, 1 + next(_databases) % 13)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def settings_factory(redis_url: str, tmp_path: Path) -> Callable[..., Settings]:
    return partial(_settings, redis_url, tmp_path)


def _settings(redis_url: str, tmp_path: Path, /, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "redis_url": redis_url,
        "data_dir": DATA_DIR,
        "n_ctx": 1024,
        "cache": {"dir": tmp_path / "kv"},
        "worker": {"heartbeat_ttl_s": 3, "maintenance_interval_s": 1},
        # Tests repeat requests to see what the worker does with them: answering them from
        # the result store is tested on its own (test_result_cache.py).
        "result_cache": {"enabled": False},
    }
    for name, value in overrides.items():
        base = values.get(name)
        # Nested settings merge, so `cache={...}` keeps the per-test cache directory.
        values[name] = (
            {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
        )
    return Settings(**values)  # type: ignore[arg-type]


@contextmanager
def _stacks(settings: Callable[..., Settings], log_dir: Path) -> Iterator[Callable[..., Stack]]:
    """Makes stacks, each started with `workers` workers; stops them all at the end."""
    stacks: list[Stack] = []

    def make(workers: int = 1, **overrides: object) -> Stack:
        api = {"port": free_port(), **overrides.pop("api", {})}  # type: ignore[dict-item]
        stack = Stack(settings(api=api, **overrides), log_dir)
        require_model_marker(stack.settings.model)
        stacks.append(stack)
        stack.start(workers)
        return stack

    try:
        yield make
    finally:
        for stack in stacks:
            stack.stop()


@pytest.fixture
def stack_factory(
    settings_factory: Callable[..., Settings], tmp_path: Path
) -> Iterator[Callable[..., Stack]]:
    with _stacks(settings_factory, tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def module_stack_factory(
    redis_base_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Stack]]:
    """Stacks that a module's tests share, for tests that only send requests and read what
    comes back, where a start per test would cost more than the test. The database (14 or
    15) and the cache directory are the module's: nothing empties them between its tests."""
    url = _db_url(redis_base_url, 14 + next(_module_databases) % 2)
    client = redis.Redis.from_url(url)
    client.flushdb()
    log_dir = tmp_path_factory.mktemp("shared-stack")
    with _stacks(partial(_settings, url, log_dir), log_dir) as make:
        yield make
    client.flushdb()
    client.close()


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Stack:
    return stack_factory()


@pytest.fixture
def outage_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private Redis (append-only file on) that the test stops and starts again. Ask for it
    before `stack_factory`: fixtures end in reverse order, so the stack stops while it runs."""
    with RedisProcess(tmp_path / "redis", free_port()) as server:
        yield server
