"""Rate-limited logging and waiting out Redis, with an injected clock and a scripted client."""

from __future__ import annotations

import logging

import pytest
import redis

from shared.log_limit import RateLimitedLog
from shared.redis_outage import Backoff, RedisWaiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_a_repeated_failure_is_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t"), interval_s=10, clock=clock)
    with caplog.at_level(logging.INFO):
        for _ in range(30):  # 100 failures a second for 30 s
            for _ in range(100):
                limited.failure("down (%s)", "refused")
            clock.now += 1
        limited.recovered("up again")
    assert messages(caplog) == [
        "down (refused)",
        "down (refused) (1000 more in the last 10 s)",
        "down (refused) (1000 more in the last 10 s)",
        "up again (after 3000 failures over 30.0 s)",
    ]


def test_recovery_without_failures_is_silent_and_a_new_run_starts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t"), interval_s=10, clock=clock)
    with caplog.at_level(logging.INFO):
        limited.recovered("up again")
        limited.failure("down")
        limited.recovered("up again")
        clock.now += 1
        limited.failure("down")
    assert messages(caplog) == ["down", "up again (after 1 failures over 0.0 s)", "down"]


def test_only_logged_lines_carry_the_traceback(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t"), interval_s=10, clock=Clock())
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            limited.failure("read failed", exc_info=ValueError("bad"))
    assert [r.exc_info is not None for r in caplog.records] == [True]


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(first_s=0.1, max_s=0.5)
    assert [backoff.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next() == 0.1


class FlakyRedis:
    """Answers PING after `down_for` refusals."""

    def __init__(self, down_for: int) -> None:
        self.down_for = down_for
        self.pings = 0

    def ping(self) -> bool:
        self.pings += 1
        if self.pings <= self.down_for:
            raise redis.ConnectionError("Connection refused")
        return True


def test_waiter_retries_a_call_once_redis_answers(caplog: pytest.LogCaptureFixture) -> None:
    client = FlakyRedis(down_for=3)
    slept: list[float] = []
    waiter = RedisWaiter(client, logging.getLogger("t"), max_delay_s=0.3, sleep=slept.append)  # type: ignore[arg-type]
    calls = []

    def work() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise redis.ConnectionError("Connection refused")
        return "done"

    with caplog.at_level(logging.INFO):
        assert waiter.call(work) == "done"
    assert len(calls) == 2 and client.pings == 4
    assert slept == [0.1, 0.2, 0.3, 0.3]
    assert messages(caplog) == [
        "Redis unavailable (ConnectionError: Connection refused); waiting for it",
        "Redis answers again (after 4 failures over 0.0 s)",
    ]


def test_waiter_lets_other_errors_through() -> None:
    waiter = RedisWaiter(FlakyRedis(0), logging.getLogger("t"), sleep=lambda _: None)  # type: ignore[arg-type]

    def broken() -> None:
        raise redis.ResponseError("WRONGTYPE")

    with pytest.raises(redis.ResponseError):
        waiter.call(broken)
