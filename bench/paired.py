"""Peers measured as users compare them: side by side, in alternating rounds, a ratio per round.

A host's speed drifts between minutes (up to 2.5 times between phases here), so a ratio of two
medians taken minutes apart can say more about the host than about the systems. Each round
runs every system once, back to back, the order rotating round by round (`in_turn`): what
runs just before a system (a peer's leftover work, a host phase's start) is not always the same
one. Its ratio compares them under the same conditions, and the median and range over rounds
say how steady that is. What else the host ran during a round
(CPU spent outside this process and its children) is stated beside it, so a disturbed round
shows as one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def in_turn(systems: Sequence[T], round_index: int) -> list[T]:
    """The order in which round `round_index` runs `systems`: each round starts one further."""
    start = round_index % len(systems) if systems else 0
    return [*systems[start:], *systems[:start]]


def ratio_summary(ratios: Sequence[float]) -> str:
    """One ratio per round, as its median and its range."""
    ordered = sorted(ratios)
    return f"{statistics.median(ordered):.2f}× ({ordered[0]:.2f}–{ordered[-1]:.2f})"


def per_round(ours: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """Round by round, our value over theirs."""
    return [o / t for o, t in zip(ours, theirs, strict=True)]


class ForeignCpu:
    """Measures, over a `with` block, the CPU the host spent outside this process and its
    descendants (the systems it started), as a share of all its cores."""

    def __init__(self) -> None:
        self.share = 0.0
        self._host_s = 0.0
        self._ours: dict[int, float] = {}
        self._started = 0.0

    def __enter__(self) -> ForeignCpu:
        self._host_s, self._ours = _host_busy_s(), _tree_cpu_s()
        self._started = time.monotonic()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        wall = time.monotonic() - self._started
        host = _host_busy_s() - self._host_s
        ours_now = _tree_cpu_s()
        # A process of ours that ended during the block took its CPU time with it: counted
        # as foreign, which only ever overstates the disturbance.
        ours = sum(s - self._ours.get(pid, 0.0) for pid, s in ours_now.items())
        cores = len(os.sched_getaffinity(0))
        self.share = max(0.0, host - ours) / (wall * cores) if wall > 0 else 0.0


def shares_text(shares: Sequence[float]) -> str:
    return ", ".join(f"{s:.0%}" for s in shares)


def foreign_line(shares: Sequence[float]) -> str:
    """The line a peer comparison ends with: what else the host ran, round by round."""
    return f"CPU the host spent on anything else, per round: {shares_text(shares)}."


def no_peer_line(what: str) -> str:
    """Said in place of the peer's `what` (rows, a column) when llama-server was not built."""
    return f"llama-server was not built (`make peer-server`): no peer {what}."


def _host_busy_s() -> float:
    """CPU seconds the host spent busy, all cores, from /proc/stat's first line: user nice
    system idle iowait irq softirq steal (guest time is inside user)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / _TICKS_PER_S


def _tree_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of this process and every descendant, by pid."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # The command name is in parentheses and may hold spaces: fields start after it.
        fields = stat.rsplit(")", 1)[1].split()
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    ours = {os.getpid()}
    grew = True
    while grew:
        children = {pid for pid, parent in parents.items() if parent in ours} - ours
        grew = bool(children)
        ours |= children
    return {pid: cpu[pid] for pid in ours if pid in cpu}
