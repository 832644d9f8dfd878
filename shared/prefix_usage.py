"""Which document prefixes requests use, learned from traffic, so the warmer can keep them warm.

Workers record every request that declares a shared prefix (a `document`): one use, and a hit
when its whole prefix came from memory or the cache, else a miss. The record keeps what is
needed to render the prefix again (the document fields, not tokens), so after a model change
the warmer re-warms the same documents for the new model. Bounded: the least used prefixes are
dropped beyond `max_prefixes`, and a prefix nobody uses for `ttl_s` expires.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from redis import Redis

from shared import codec, keys
from shared.schemas import DocumentFields, WarmItem


def prefix_id(item: WarmItem | DocumentFields, namespace: str | None) -> str:
    """Names a prefix by what renders it (whatever the model), within one cache namespace."""
    fields = item.model_dump(
        include=set(WarmItem.model_fields) - {"name"}, exclude_none=True, exclude_defaults=True
    )
    # Whatever the default: a raw document keeps the id it had before document_format existed,
    # and every other format is named.
    fields.pop("document_format", None)
    if item.document is not None and item.document_format != "raw":
        fields["document_format"] = item.document_format
    data = codec.dumps({"item": fields, "namespace": namespace})
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def document_prefix_id(document: DocumentFields, namespace: str | None) -> str:
    """A request's document prefix as the warmer names it (routing names it so too)."""
    return prefix_id(WarmItem.model_validate(document.model_dump()), namespace)


@dataclass(frozen=True, slots=True)
class LearnedPrefix:
    id: str
    item: WarmItem
    namespace: str | None
    uses: int
    hits: int
    misses: int


class PrefixUsage:
    def __init__(self, redis: Redis, max_prefixes: int = 1000, ttl_s: int = 30 * 86_400) -> None:
        self._redis = redis
        self._max = max_prefixes
        self._ttl_s = ttl_s

    def record(self, document: DocumentFields, namespace: str | None, *, hit: bool) -> None:
        item = WarmItem.model_validate(document.model_dump())
        pid = document_prefix_id(document, namespace)
        key = keys.prefix_usage(pid)
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.zincrby(keys.prefix_uses(), 1, pid)
            pipe.hset(
                key,
                mapping={"item": item.model_dump_json(), "namespace": namespace or ""},
            )
            pipe.hincrby(key, "hits" if hit else "misses", 1)
            pipe.expire(key, self._ttl_s)
            pipe.zcard(keys.prefix_uses())
            *_, size = pipe.execute()
        if size > self._max:
            self._drop_least_used(size - self._max)

    def _drop_least_used(self, count: int) -> None:
        dropped: list[tuple[bytes, float]] = self._redis.zpopmin(keys.prefix_uses(), count)  # type: ignore[assignment]
        if dropped:
            self._redis.delete(*(keys.prefix_usage(pid.decode()) for pid, _ in dropped))

    def top(self, k: int, min_uses: int = 1) -> list[LearnedPrefix]:
        """The `k` most used prefixes used at least `min_uses` times, most used first."""
        ranked: list[tuple[bytes, float]] = self._redis.zrevrangebyscore(  # type: ignore[assignment]
            keys.prefix_uses(), "+inf", min_uses, start=0, num=k, withscores=True
        )
        learned = []
        for raw_id, uses in ranked:
            pid = raw_id.decode()
            record: dict[bytes, bytes] = self._redis.hgetall(keys.prefix_usage(pid))  # type: ignore[assignment]
            if b"item" not in record:  # expired: its use count goes with it
                self._redis.zrem(keys.prefix_uses(), pid)
                continue
            learned.append(
                LearnedPrefix(
                    id=pid,
                    item=WarmItem.model_validate_json(record[b"item"]),
                    namespace=record.get(b"namespace", b"").decode() or None,
                    uses=int(uses),
                    hits=int(record.get(b"hits", 0)),
                    misses=int(record.get(b"misses", 0)),
                )
            )
        return learned
