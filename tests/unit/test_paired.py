"""What bench/paired.py reports beside a peer comparison: the ratio per round, and the CPU the
host spent outside the systems being measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.paired import ForeignCpu, _tree_cpu_s, in_turn, per_round, ratio_summary

BURN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_a_ratio_is_taken_within_each_round_and_summed_up_as_median_and_range() -> None:
    ours, theirs = [2.0, 1.0, 3.0], [1.0, 1.0, 1.0]
    assert per_round(ours, theirs) == [2.0, 1.0, 3.0]
    assert ratio_summary(per_round(ours, theirs)) == "2.00\u00d7 (1.00\u20133.00)"


def test_each_round_starts_with_the_next_system_and_runs_every_one_once() -> None:
    systems = ("granary", "granary, flash off", "peer")
    orders = [in_turn(systems, k) for k in range(4)]
    assert orders[0] == list(systems)
    assert [order[0] for order in orders] == ["granary", "granary, flash off", "peer", "granary"]
    assert all(sorted(order) == sorted(systems) for order in orders)
    assert in_turn((), 3) == []


@contextmanager
def _burning(orphan: bool) -> Iterator[int]:
    """A process spinning on a core: a child of this one, or an orphan (its parent, a shell,
    exits at once and init adopts it), as a process nothing here started would be."""
    if not orphan:
        child = subprocess.Popen([sys.executable, "-c", BURN])
        try:
            yield child.pid
        finally:
            child.kill()
            child.wait()
        return
    shell = f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!'
    pid = int(subprocess.run(["sh", "-c", shell, BURN], capture_output=True, text=True).stdout)
    try:
        yield pid
    finally:
        subprocess.run(["kill", str(pid)], check=False)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_this_process_and_its_children_are_ours_an_orphan_is_not() -> None:
    with _burning(orphan=False) as child, _burning(orphan=True) as orphan:
        ours = _tree_cpu_s()
    assert child in ours and orphan not in ours


def test_a_foreign_process_counts_at_least_its_own_cpu() -> None:
    with _burning(orphan=True) as orphan:
        before = _cpu_s(orphan)
        started = time.monotonic()
        with ForeignCpu() as cpu:
            time.sleep(1.0)  # the time window measured, not a wait for an event
        spent = _cpu_s(orphan) - before
        wall = time.monotonic() - started
    cores = len(os.sched_getaffinity(0))
    assert spent > 0
    # Ticks are 10 ms: allow two on each side of the window.
    assert cpu.share * wall * cores >= spent - 0.04
