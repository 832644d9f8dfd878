"""Cache-aware routing: a job goes to the worker whose memory holds its document's prefix.

Conclave workers advertise, about every second, the document prefixes their memory holds
(`granary:holder:<prefix id>` -> worker) and how many more jobs they can take now
(`granary:room:<worker>`), all expiring within seconds unless refreshed: a dead worker's
affinity goes with it. When the API enqueues a job about a document a live worker holds, and
that worker has room, the job goes onto the worker's private list for its class (the rq queue
`interactive@<worker>`), which the worker reads before the shared one.

rq stays the queue. The job is enqueued on its shared queue as always, so its `origin` and with
it its started and failed registries, retries and the re-run after a kill -9 are the shared
queue's; in the same transaction its id moves from the shared list's tail to the private list.
Private lists are not registered as rq queues (a worker only dequeues from them), so `rq info`
shows what it showed before; `/metrics` counts them in the queue depth.
A routed job its worker has not taken within `routing.wait_s`, or whose worker stopped
advertising, goes to the front of the shared queue, moved by any worker with one script that
takes it from the private list only if it is still there: never lost, never run twice.

With one worker nothing is routed (the route needs two live workers), so the default
deployment runs exactly as without routing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis import Redis
from redis.client import Pipeline
from rq import Queue

from shared import keys

# A worker advertises about every second; three missed beats and its holdings and room are gone.
ADVERTISE_TTL_S = 3
QUEUE_PREFIX = Queue.redis_queue_namespace_prefix
PRIVATE_MARK = "@"

# TIME before writes needs effects replication on Redis < 7 (a no-op from 7 on).
_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
"""

# KEYS: holder, shared list, routed, routing workers.
# ARGV: job id, shared queue name, room key prefix, queue key prefix.
# Runs in the enqueue's transaction, after rq pushed the job onto the shared list. Returns the
# worker the job went to, or false (it stays where rq put it).
_ROUTE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if redis.call('ZCARD', KEYS[4]) < 2 then return false end
local owner = redis.call('GET', KEYS[1])
if not owner then return false end
local room_key = ARGV[3] .. owner
if tonumber(redis.call('GET', room_key) or '0') <= 0 then return false end
if redis.call('LREM', KEYS[2], -1, ARGV[1]) == 0 then return false end
redis.call('DECR', room_key)
local private = ARGV[2] .. '@' .. owner
redis.call('RPUSH', ARGV[4] .. private, ARGV[1])
redis.call('ZADD', KEYS[3], now, private .. ' ' .. ARGV[1])
return owner
"""
)

# KEYS: room, routing workers. ARGV: worker, ttl_s, capacity, holder key prefix, the number of
# private lists, the private lists' keys, then the held prefix ids.
# Room is what the worker can take minus what already waits in its private lists.
_ADVERTISE = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
local lists = tonumber(ARGV[5])
local waiting = 0
for i = 6, 5 + lists do waiting = waiting + redis.call('LLEN', ARGV[i]) end
redis.call('SET', KEYS[1], math.max(0, tonumber(ARGV[3]) - waiting), 'EX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
for i = 6 + lists, #ARGV do redis.call('SET', ARGV[4] .. ARGV[i], ARGV[1], 'EX', ttl) end
return waiting
"""
)

# KEYS: routed. ARGV: wait_s, room key prefix, queue key prefix.
# Every routed job waiting longer than wait_s, or whose worker no longer advertises, goes to the
# front of its shared queue (the newest first, so the oldest ends up in front). Returns how many.
_SWEEP = (
    _NOW
    + """
local due = now - tonumber(ARGV[1])
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local moved = 0
for i = #entries - 1, 1, -2 do
  local member = entries[i]
  local private, job = string.match(member, '^(%S+) (%S+)$')
  local shared, owner = string.match(private or '', '^([^@]+)@(.+)$')
  if not owner then
    redis.call('ZREM', KEYS[1], member)
  elseif tonumber(entries[i + 1]) <= due or redis.call('EXISTS', ARGV[2] .. owner) == 0 then
    if redis.call('LREM', ARGV[3] .. private, 1, job) == 1 then
      redis.call('LPUSH', ARGV[3] .. shared, job)
      moved = moved + 1
    end
    redis.call('ZREM', KEYS[1], member)
  end
end
return moved
"""
)

# KEYS: room, routing workers, routed. ARGV: worker, queue key prefix, shared queue names.
# A worker that stops: nothing more is routed to it, and what waits for it goes to the front of
# the shared queues, in order. Returns how many jobs went back.
_WITHDRAW = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local moved = 0
for i = 3, #ARGV do
  local private = ARGV[i] .. '@' .. ARGV[1]
  local job = redis.call('RPOP', ARGV[2] .. private)
  while job do
    redis.call('LPUSH', ARGV[2] .. ARGV[i], job)
    redis.call('ZREM', KEYS[3], private .. ' ' .. job)
    moved = moved + 1
    job = redis.call('RPOP', ARGV[2] .. private)
  end
end
return moved
"""


def private_queue(shared: str, worker: str) -> str:
    """The rq queue holding jobs routed to `worker` from `shared`."""
    return f"{shared}{PRIVATE_MARK}{worker}"


def routed_member(private: str, job_id: str) -> str:
    return f"{private} {job_id}"


def _routed_here(redis: Redis, shared: str) -> list[str]:
    """Members of the routed set for jobs of one shared queue."""
    members: list[bytes] = redis.zrange(keys.routed(), 0, -1)  # type: ignore[assignment]
    start = f"{shared}{PRIVATE_MARK}"
    return [m.decode() for m in members if m.decode().startswith(start)]


def waiting(redis: Redis, shared: str) -> int:
    """Jobs of one class waiting in workers' private lists (queue depth counts them too).

    Every job in a private list has its entry in the routed set (both are written together),
    so the lists named there are all of them; an entry can outlive its job briefly, so the
    lists themselves are counted."""
    lists = sorted({m.partition(" ")[0] for m in _routed_here(redis, shared)})
    if not lists:
        return 0
    with redis.pipeline(transaction=False) as pipe:
        for name in lists:
            pipe.llen(QUEUE_PREFIX + name)
        return sum(pipe.execute())


def unqueue(redis: Redis, shared: str, job_id: str) -> None:
    """Take a cancelled job out of the private list holding it, if one does."""
    for member in _routed_here(redis, shared):
        private, _, routed_id = member.partition(" ")
        if routed_id == job_id:
            redis.lrem(QUEUE_PREFIX + private, 0, job_id)
            redis.zrem(keys.routed(), member)


class Routing:
    """The scripts, registered once per connection (calls run by SHA)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._route = redis.register_script(_ROUTE)
        self._advertise = redis.register_script(_ADVERTISE)
        self._sweep = redis.register_script(_SWEEP)
        self._withdraw = redis.register_script(_WITHDRAW)

    def route(self, pipe: Pipeline, shared: str, job_id: str, prefix_id: str) -> None:
        """Queue, in `pipe`'s transaction after the job's enqueue, its move to the private
        list of the live worker holding `prefix_id`, if that worker has room."""
        route_keys = [keys.holder(prefix_id), QUEUE_PREFIX + shared, keys.routed()]
        self._route(
            keys=[*route_keys, keys.routing_workers()],
            args=[job_id, shared, keys.room(""), QUEUE_PREFIX],
            client=pipe,
        )

    def advertise(
        self, worker: str, held: Iterable[str], capacity: int, private: Sequence[str]
    ) -> None:
        """What `worker` holds and how many more jobs it can take (minus those waiting)."""
        lists = [QUEUE_PREFIX + name for name in private]
        self._advertise(
            keys=[keys.room(worker), keys.routing_workers()],
            args=[worker, ADVERTISE_TTL_S, capacity, keys.holder(""), len(lists), *lists, *held],
        )

    def sweep(self, wait_s: float) -> int:
        """Hand routed jobs nobody took in time back to their shared queues."""
        return int(self._sweep(keys=[keys.routed()], args=[wait_s, keys.room(""), QUEUE_PREFIX]))

    def withdraw(self, worker: str, shared: Sequence[str]) -> int:
        """`worker` stops: route nothing more to it; its waiting jobs go back, in order."""
        withdraw_keys = [keys.room(worker), keys.routing_workers(), keys.routed()]
        return int(self._withdraw(keys=withdraw_keys, args=[worker, QUEUE_PREFIX, *shared]))
