"""API keys: when `api_keys` is set, every /v1 route needs `Authorization: Bearer <key>`.

A key is never stored with a job: jobs carry an owner id derived from it (a hash), so a key
sees, streams and cancels only its own jobs. Keys are compared in constant time, and every
configured key is compared, so timing says nothing about which one nearly matched.
"""

from __future__ import annotations

import hashlib
import hmac

from shared.errors import Unauthorized


def owner_id(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"granary-key").hexdigest()


def caller(authorization: str, keys: list[str]) -> str | None:
    """The owner id of the key in an `Authorization` header; None when no keys are set."""
    if not keys:
        return None
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in keys]
    if not any(matches):
        raise Unauthorized("invalid API key")
    return owner_id(presented)
