"""Commands sent to every live worker, answered when each has carried them out.

A command goes over rq's own per-worker channel (`rq.command.send_command`, the one rq's
`shutdown` takes) with the name of a reply list; a worker pushes its name there once done, so
the sender waits for the event itself, never for a guessed time.
"""

from __future__ import annotations

import time
import uuid

from redis import Redis
from rq import Worker
from rq.command import send_command

from shared import keys

# Drop the prefixes a worker's memory holds idle and write its pending snapshots: what it
# computed is then on disk only, as after a restart, without reloading the model.
FORGET = "granary-forget"
REPLY_TTL_S = 300


def send_to_every_worker(
    redis: Redis, command: str, timeout_s: float = 60
) -> tuple[list[str], list[str]]:
    """(workers that answered, workers that did not within `timeout_s`)."""
    names = [worker.name for worker in Worker.all(connection=redis)]
    replies = keys.command_replies(uuid.uuid4().hex)
    for name in names:
        send_command(redis, name, command, reply=replies)
    answered: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(answered) < len(names) and (left := deadline - time.monotonic()) > 0:
        reply = redis.blpop([replies], timeout=max(left, 0.01))
        if reply is None:
            break
        who = reply[1]
        answered.append(who.decode() if isinstance(who, bytes) else who)
    redis.delete(replies)
    return answered, [name for name in names if name not in answered]


def answer(redis: Redis, replies: str, worker_name: str) -> None:
    """Tell the sender this worker has carried the command out."""
    with redis.pipeline() as pipe:
        pipe.rpush(replies, worker_name)
        pipe.expire(replies, REPLY_TTL_S)  # a sender that gave up leaves nothing behind
        pipe.execute()
