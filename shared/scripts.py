"""Lua scripts, kept in one module behind typed wrappers.

Each script makes one job-state transition atomic, so an API cancelling and a worker finishing
at the same instant can never leave a job both cancelled and finished, and a re-run after a
worker crash never publishes the same token twice.
"""

from __future__ import annotations

from typing import Any

from redis import Redis

# KEYS: job, cancel flag. ARGV: now.
# Returns the attempt number, or 0 when the job must not run (already terminal).
_START = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'started' then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'status', 'started', 'started_at', ARGV[1])
return redis.call('HINCRBY', KEYS[1], 'attempts', 1)
"""

# KEYS: job, events stream, channel, cancel flag. ARGV: first index, then an event name and its
# json per event (`token`, `answer`). Events already published (by an earlier attempt) are
# skipped; the rest go to the stream and, as one message of "seq|event|data" lines, to the
# channel. Returns 1 when the job was cancelled (the worker stops), else 0. A job whose record is
# gone (expired, or deleted from outside while it ran) counts as cancelled and gets nothing
# written: an HSET would leave a record with no status and no TTL, read back as a broken job.
_EMIT_EVENTS = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return 1 end
local emitted = tonumber(redis.call('HGET', KEYS[1], 'emitted') or '0')
local first = tonumber(ARGV[1])
local lines = {}
for i = 2, #ARGV, 2 do
  local index = first + (i - 2) / 2
  if index >= emitted then
    redis.call('XADD', KEYS[2], '*', 'seq', index, 'event', ARGV[i], 'data', ARGV[i + 1])
    lines[#lines + 1] = index .. '|' .. ARGV[i] .. '|' .. ARGV[i + 1]
    emitted = index + 1
  end
end
if #lines > 0 then
  redis.call('PUBLISH', KEYS[3], table.concat(lines, '\\n'))
  redis.call('HSET', KEYS[1], 'emitted', emitted)
end
return redis.call('EXISTS', KEYS[4])
"""

# KEYS: job, events stream, channel, cancel flag, metrics counters.
# ARGV: status, finished_at, ttl_s, then field/value pairs to store.
# A job cancelled meanwhile stays cancelled; the final event is emitted exactly once.
_FINISH = """
local current = redis.call('HGET', KEYS[1], 'status')
if current == false then return 0 end
if current == 'finished' or current == 'failed' then return 0 end
local status = ARGV[1]
if current == 'cancelled' then status = 'cancelled' end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'status', status, 'finished_at', ARGV[2], unpack(fields))
local seq = redis.call('HGET', KEYS[1], 'emitted') or '0'
local event = 'done'
if status == 'failed' then event = 'error' end
redis.call('XADD', KEYS[2], '*', 'seq', seq, 'event', event, 'data', '')
redis.call('PUBLISH', KEYS[3], seq .. '|' .. event .. '|')
local ttl = tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('DEL', KEYS[4])
redis.call('HINCRBY', KEYS[5], 'jobs_' .. status, 1)
return 1
"""

# KEYS: job, events stream, channel, cancel flag, metrics counters. ARGV: now, ttl_s.
# Returns the status before the call. A queued job ends here (its final event is emitted now);
# a started one gets a flag its worker sees within a token and ends it itself.
_CANCEL = """
local current = redis.call('HGET', KEYS[1], 'status')
if current == false then return false end
if current ~= 'queued' and current ~= 'started' then return current end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
if current == 'queued' then
  local seq = redis.call('HGET', KEYS[1], 'emitted') or '0'
  redis.call('XADD', KEYS[2], '*', 'seq', seq, 'event', 'done', 'data', '')
  redis.call('PUBLISH', KEYS[3], seq .. '|done|')
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('HINCRBY', KEYS[5], 'jobs_cancelled', 1)
else
  redis.call('SET', KEYS[4], '1', 'EX', ARGV[2])
end
return current
"""


# KEYS: job. ARGV: progress json. A started job goes back to queued (it stepped aside for
# other work), unless it was cancelled meanwhile. Returns 1 when requeued.
_REQUEUE = """
if redis.call('HGET', KEYS[1], 'status') ~= 'started' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'warm', ARGV[1])
return 1
"""


# KEYS: result entry, result index. ARGV: entry json, ttl_s, now, max entries, digest, entry
# key prefix. Stores one result and trims the index: entries unused for ttl_s have expired,
# and beyond max entries the least recently used go.
_RECORD_RESULT = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local now = tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - tonumber(ARGV[2])))
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  local gone = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #gone, 2 do redis.call('DEL', ARGV[6] .. gone[i]) end
end
return 1
"""


class Scripts:
    """Registered once per connection; calls run by SHA (EVALSHA)."""

    def __init__(self, redis: Redis) -> None:
        self._start = redis.register_script(_START)
        self._emit_events = redis.register_script(_EMIT_EVENTS)
        self._finish = redis.register_script(_FINISH)
        self._cancel = redis.register_script(_CANCEL)
        self._requeue = redis.register_script(_REQUEUE)
        self._record_result = redis.register_script(_RECORD_RESULT)

    def start(self, keys: tuple[str, str], now_s: float) -> int:
        return int(self._start(keys=list(keys), args=[now_s]))

    def emit_events(
        self, keys: tuple[str, str, str, str], first: int, events: list[tuple[str, bytes]]
    ) -> bool:
        flat: list[str | bytes] = []
        for name, data in events:
            flat += [name, data]
        return bool(self._emit_events(keys=list(keys), args=[first, *flat]))

    def finish(
        self,
        keys: tuple[str, str, str, str, str],
        status: str,
        now_s: float,
        ttl_s: int,
        fields: dict[str, Any],
    ) -> bool:
        flat: list[Any] = []
        for name, value in fields.items():
            flat += [name, value]
        return bool(self._finish(keys=list(keys), args=[status, now_s, ttl_s, *flat]))

    def cancel(self, keys: tuple[str, str, str, str, str], now_s: float, ttl_s: int) -> str | None:
        previous = self._cancel(keys=list(keys), args=[now_s, ttl_s])
        if previous is None:
            return None
        return previous.decode() if isinstance(previous, bytes) else str(previous)

    def requeue(self, job_key: str, progress: str) -> bool:
        return bool(self._requeue(keys=[job_key], args=[progress]))

    def record_result(
        self,
        keys: tuple[str, str],
        entry: bytes,
        ttl_s: int,
        now_s: float,
        max_entries: int,
        digest: str,
        prefix: str,
    ) -> None:
        args: list[bytes | str | int | float] = [entry, ttl_s, now_s, max_entries, digest, prefix]
        self._record_result(keys=list(keys), args=args)
