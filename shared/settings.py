"""One `Settings` for every process: env vars `GRANARY_*`, an optional TOML file, defaults.

Built once at process start (`load_settings`) and passed down; nothing else reads the
environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from shared.schemas import DocumentFormat, DocumentType

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CONFIG_FILE = Path("granary.toml")


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    idempotency_ttl_s: int = Field(86_400, gt=0)
    # A larger body is refused (413) before it is read whole or parsed. 8 MiB holds a
    # 1,000-page text document; batches of many documents need more, or several requests.
    max_body_bytes: int = Field(8 * 1024**2, ge=1024)
    # Requests rendered and tokenized at once; more wait, so a few huge prompts cannot take
    # every thread of the API while short ones queue behind them.
    tokenize_concurrency: int = Field(2, ge=1)
    # With api_keys set, /docs and /openapi.json need a key too unless this is true.
    open_docs: bool = False
    # The async Redis pool behind event streams: one connection is the shared pub/sub, the
    # rest read stream backlogs (reads beyond that queue for a turn).
    redis_max_connections: int = Field(32, ge=2, le=10_000)
    # Each Redis call of the API (connecting, waiting for a pooled connection, reading the
    # reply, together) gets this long before the request gets a 503: a frozen Redis (a stopped
    # process, a stalled host, a partition dropping packets) answers nothing, and without a
    # deadline a request waits on it forever. A healthy Redis answers in well under 10 ms.
    redis_timeout_s: float = Field(3.0, gt=0, le=60)


class WorkerSettings(BaseModel):
    # How long a silent worker's job stays claimed before another worker re-runs it.
    heartbeat_ttl_s: int = Field(30, ge=3)
    # How often an idle worker looks for jobs abandoned by dead workers.
    maintenance_interval_s: int = Field(15, ge=1)
    job_timeout_s: int = Field(3_600, gt=0)
    max_retries: int = Field(2, ge=0)
    # Tokens decoded within this window are published together: fewer wake-ups of Redis,
    # the API and clients, whose CPU time a small machine would otherwise take from decoding.
    stream_interval_ms: int = Field(50, ge=0, le=1000)
    # Jobs one worker serves at once (the Conclave, worker/conclave/): their tokens are decoded
    # together, one llama_decode per step, and a new prompt is prefilled a chunk at a time
    # between steps. 1: one job at a time (a warm job then steps aside for a waiting job).
    max_active_jobs: int = Field(8, ge=1, le=48)
    # Sequences of the Conclave's context (None: max_active_jobs + 4), each with a KV buffer of
    # n_ctx cells of its own: memory is sequences x n_ctx x the model's KV bytes per token.
    # Beyond one per job they hold extraction questions and prefixes kept for reuse.
    sequences: int | None = Field(None, ge=2, le=256)
    # True: a job's greedy output does not depend on what is decoded beside it. With kernels
    # whose batched rows equal lone ones (the wheel `make install` builds; checked at start,
    # worker/conclave/row_check.py) that holds as it is. Otherwise a greedy row whose top two
    # logits nearly tie is decided again alone (worker/conclave/near_tie.py); False skips
    # those replays: faster, but such rows can differ from a lone run's.
    exact_batching: bool = True


class RoutingSettings(BaseModel):
    # With several workers, a job whose document prefix a live worker holds in memory goes to
    # that worker while it has room (shared/routing.py): it skips the prefill or disk restore.
    # One worker alone never has its jobs routed, so it runs exactly as without this.
    enabled: bool = True
    # A routed job its worker has not taken within this long goes to the front of the shared
    # queue, where any worker takes it: the bound on what waiting for memory may cost.
    wait_s: float = Field(2.0, gt=0, le=300)


class JobSettings(BaseModel):
    default_max_tokens: int = Field(256, gt=0)
    result_ttl_s: int = Field(86_400, gt=0)
    # For requests that do not say (worker/conclave/drafts.py). Off until `auto` never costs
    # more than 3% on any bench workload; SmolLM2's free text, one stream, still moves across
    # that line from run to run (docs/BENCHMARKS.md, "Speculative decoding").
    speculation: Literal["auto", "on", "off"] = "off"


class CacheSettings(BaseModel):
    enabled: bool = True
    # Give each API key its own cache (and no shared in-memory prefix), so one tenant cannot
    # learn another's prompts from how fast their requests start.
    per_key: bool = False
    # None: `<data_dir>/kv`.
    dir: Path | None = None
    max_bytes: int = Field(10 * 1024**3, ge=0)
    # Prefill runs in chunks of this size too, so keep it <= n_batch.
    block_tokens: int = Field(256, ge=16)
    # Shorter prompts are cheap to recompute and not worth a file.
    min_tokens: int = Field(32, ge=1)
    # A state that extends a stored one stores only its own cells (plain-attention models;
    # shared/prefix_cache/deltas.py). Off: every state is stored whole.
    deltas: bool = True
    # How much slower than with no save decode passes may run beside one: once a save slowed
    # them more, saves wait while the model is busy (worker/save_yield.py; the seeds' alarm).
    save_slowdown_limit: float = Field(0.15, ge=0)


class ResultCacheSettings(BaseModel):
    """Finished results answering identical requests again (shared/result_cache.py)."""

    # Only greedy or explicitly seeded requests are answered from it; `cache: false` on a
    # request bypasses it both ways.
    enabled: bool = True
    # From when the result was recorded; a used entry is not kept longer.
    ttl_s: int = Field(3_600, gt=0)
    # Entries beyond this go, least recently used first.
    max_entries: int = Field(10_000, ge=1)
    # A larger result (its events and record) is not stored: the store is bounded by
    # max_entries x this.
    max_entry_bytes: int = Field(1024**2, ge=1024)


class WarmSpec(BaseModel):
    """A declared prefix family: documents introduced the same way as real requests do."""

    model_config = {"extra": "forbid"}

    name: str
    # The same `instructions` and `template` the requests for these documents send.
    instructions: str | None = None
    template: str | None = None
    # Files or glob patterns; relative ones from the spec file's directory (or the cwd).
    documents: list[str] = Field(min_length=1)
    # As requests for these documents send them: the warmed prefix is the normalised text.
    document_format: DocumentFormat = "facts"
    document_type: DocumentType | None = None


class WarmerSettings(BaseModel):
    # Cron: 5 fields (minute hour day month weekday), or 6 with seconds first.
    schedule: str = "0 3 * * *"
    # IANA name; None: the machine's local time zone.
    timezone: str | None = None
    # A run the scheduler could not start on time still starts if at most this late.
    misfire_grace_s: int = Field(6 * 3600, gt=0)
    # A warmer that was down when a run was due runs once at start (however many it missed).
    catch_up: bool = True
    specs: list[WarmSpec] = Field(default_factory=list)
    # Every *.toml file here is one spec (its `name` defaults to the file name).
    spec_dir: Path | None = None
    # Each run also re-warms the most used document prefixes learned from traffic.
    learned_top_k: int = Field(20, ge=0)
    learned_min_uses: int = Field(2, ge=1)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GRANARY_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    redis_url: str = DEFAULT_REDIS_URL
    data_dir: Path = Path("~/.local/share/granary")
    model: str = "smollm2-135m"
    n_ctx: int = Field(4096, ge=64)
    # None: every core the process may run on, divided between the host's workers.
    n_threads: int | None = Field(None, ge=1)
    # Workers sharing this host's cores (compose's replicas): llama.cpp's threads spin while they
    # wait, so workers whose threads overlap slow each other down many times over.
    workers_per_host: int = Field(1, ge=1)
    n_batch: int = Field(512, ge=1)
    # llama.cpp's flash-attention kernel (what llama-server's `-fa auto` picks on a CPU): faster
    # prefill, the more so the longer the prompt (docs/BENCHMARKS.md, "Cold prefill beside
    # llama-server"). The wheel `make install` builds tiles every pass, so short prompt chunks
    # past a long context are faster with it too and a decode step costs about the same
    # (docs/BENCHMARKS.md, "Flash attention by the rows of a pass").
    # Exact in the Conclave with the wheel `make install` builds, which splits a decode row's
    # cells only at fixed segments, never by thread or by the rows beside it (its start-up row
    # check says so). Cells computed with and without it differ in rounding and layout, so it
    # is part of the cache fingerprint: neither reads the other's states.
    flash_attn: bool = True
    log_level: str = "INFO"
    # Comma-separated in GRANARY_API_KEYS. Empty: no authentication.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    api: ApiSettings = ApiSettings()
    worker: WorkerSettings = WorkerSettings()
    jobs: JobSettings = JobSettings()
    cache: CacheSettings = CacheSettings()
    result_cache: ResultCacheSettings = ResultCacheSettings()
    routing: RoutingSettings = RoutingSettings()
    warmer: WarmerSettings = WarmerSettings()

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @property
    def threads(self) -> int:
        return self.n_threads or max(1, len(os.sched_getaffinity(0)) // self.workers_per_host)

    @property
    def cache_dir(self) -> Path:
        return (self.cache.dir or self.data_dir / "kv").expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit arguments, then environment, then the TOML file.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


def config_path(explicit: Path | None = None) -> Path | None:
    """The TOML file to read: `--config`, else `GRANARY_CONFIG`, else ./granary.toml if present."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get("GRANARY_CONFIG")
    if from_env:
        return Path(from_env)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


def load_settings(config: Path | None = None, **overrides: Any) -> Settings:
    path = config_path(config)
    if path is None:
        return Settings(**overrides)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=path)

    return _FromFile(**overrides)
