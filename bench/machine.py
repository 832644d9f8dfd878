"""What the numbers were measured on, stated next to them."""

from __future__ import annotations

import os
import platform
import time
from importlib.metadata import version
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 0.0


def describe() -> str:
    return (
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        f"- Machine: {_cpu_model()} ({platform.machine()}), "
        f"{len(os.sched_getaffinity(0))} cores usable, {_ram_gib():.0f} GiB RAM, "
        f"Linux {platform.release()}\n"
        f"- Software: Python {platform.python_version()}, "
        f"llama-cpp-python {version('llama-cpp-python')}, rq {version('rq')}, "
        f"redis-py {version('redis')}\n"
    )
