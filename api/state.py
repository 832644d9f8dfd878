"""What the API process holds for its life, built once in the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from llama_cpp import Llama
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from api.batches import Batches
from api.event_hub import EventHub
from shared.job_store import JobStore
from shared.prefix_cache import PrefixCache
from shared.settings import Settings
from shared.submission import Submitter
from shared.warm_runs import WarmRuns


@dataclass(frozen=True, slots=True)
class AppState:
    settings: Settings
    redis: Redis
    aredis: AsyncRedis
    tokenizer: Llama
    store: JobStore
    submitter: Submitter
    warm_runs: WarmRuns
    batches: Batches
    hub: EventHub
    cache: PrefixCache | None
