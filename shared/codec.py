"""JSON everywhere (never pickle): rq's job payloads and granary's own records."""

from __future__ import annotations

from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """Sorted keys: equal values always give equal bytes (they are hashed into ids)."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


class JsonSerializer:
    """rq serializer: job arguments and results travel as JSON."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return orjson.loads(data)
