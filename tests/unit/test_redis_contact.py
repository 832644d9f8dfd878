"""A worker's contact with Redis: lost while a call fails or stalls, unbroken only after (with
an injected clock; the calls are plain functions that take the time a Redis call would)."""

from __future__ import annotations

import pytest
import redis

from worker.redis_contact import RedisContact

STALL_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def taking(clock: Clock, seconds: float) -> None:
    clock.now += seconds


def test_contact_counts_from_the_start_and_quick_calls_keep_it() -> None:
    clock = Clock()
    contact = RedisContact(STALL_S, clock)
    for _ in range(10):
        contact.timed(lambda: taking(clock, 0.01))
        clock.now += 0.5
    assert contact.unbroken_s() == pytest.approx(5.1)


def test_a_stalled_call_breaks_contact_until_it_comes_back() -> None:
    clock = Clock()
    contact = RedisContact(STALL_S, clock)
    clock.now += 30
    seen_meanwhile = []

    def frozen() -> None:
        taking(clock, 6)
        seen_meanwhile.append(contact.unbroken_s())  # another thread asking, mid-stall

    contact.timed(frozen)
    assert seen_meanwhile == [0.0]
    assert contact.unbroken_s() == 0.0
    clock.now += 2
    assert contact.unbroken_s() == pytest.approx(2)


def test_a_failed_call_breaks_contact_however_quick() -> None:
    clock = Clock()
    contact = RedisContact(STALL_S, clock)
    clock.now += 30

    def refused() -> None:
        raise redis.ConnectionError("refused")

    with pytest.raises(redis.ConnectionError):
        contact.timed(refused)
    assert contact.unbroken_s() == 0.0


def test_other_errors_pass_through_and_leave_contact_alone() -> None:
    clock = Clock()
    contact = RedisContact(STALL_S, clock)
    clock.now += 30

    def broken() -> None:
        raise ValueError("not Redis")

    with pytest.raises(ValueError):
        contact.timed(broken)
    assert contact.unbroken_s() == pytest.approx(30)
