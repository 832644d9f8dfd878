"""The HTTP API: a FastAPI app built from settings, serving jobs and streaming their tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError

from api import errors
from api.batches import Batches
from api.event_hub import EventHub
from api.guard import RequestGuard
from api.routes import ROUTERS
from api.state import AppState
from shared.job_store import JobStore
from shared.llm import load_llama
from shared.prefix_cache import open_cache
from shared.redis_server import QUICK_BACKOFF, QUICK_RETRIES, connect, deadline_kwargs
from shared.result_cache import open_results
from shared.settings import Settings
from shared.submission import Submitter
from shared.warm_runs import WarmRuns


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, deadline_s=settings.api.redis_timeout_s)
        aredis = _async_redis(settings)
        tokenizer = load_llama(settings, vocab_only=True)
        store = JobStore(redis, settings.jobs.result_ttl_s)
        submitter = Submitter(redis, store, tokenizer, settings, open_results(redis, settings))
        # One pool connection is the hub's pub/sub; the others serve backlog reads.
        hub = EventHub(
            aredis,
            backlog_reads=settings.api.redis_max_connections - 1,
            deadline_s=settings.api.redis_timeout_s,
        )
        await hub.start()
        app.state.granary = AppState(
            settings=settings,
            redis=redis,
            aredis=aredis,
            tokenizer=tokenizer,
            store=store,
            submitter=submitter,
            warm_runs=WarmRuns(redis, store, settings),
            batches=Batches(redis, store, submitter, settings.jobs.result_ttl_s),
            hub=hub,
            cache=open_cache(settings) if settings.cache.enabled else None,
        )
        try:
            yield
        finally:
            await hub.stop()
            await aredis.aclose()
            redis.close()
            tokenizer.close()

    app = FastAPI(title="granary", version="0.1.0", lifespan=lifespan)
    app.add_middleware(RequestGuard, settings=settings)
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _async_redis(settings: Settings) -> AsyncRedis:
    """A pool that makes a request wait for a free connection instead of failing at once; the
    event hub bounds each of its calls (the wait, connecting, the reply) by the deadline."""
    timeout_s = settings.api.redis_timeout_s
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.api.redis_max_connections,
        timeout=timeout_s,
        # As the sync client's (shared/redis_server.py): a timeout is never retried.
        retry=Retry(QUICK_BACKOFF, QUICK_RETRIES, supported_errors=(RedisConnectionError,)),
        **deadline_kwargs(timeout_s),
    )
    return AsyncRedis.from_pool(pool)


def serve(settings: Settings) -> None:
    uvicorn.run(
        create_app(settings),
        host=settings.api.host,
        port=settings.api.port,
        log_level=settings.log_level.lower(),
    )
