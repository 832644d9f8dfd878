"""One module per resource; `ROUTERS` is what the app mounts, in this order."""

from __future__ import annotations

from api.routes import batches, cache, extractions, health, jobs, metrics, openai, warm

ROUTERS = (
    health.router,
    jobs.router,
    extractions.router,
    batches.router,
    cache.router,
    openai.router,
    warm.router,
    metrics.router,
)
