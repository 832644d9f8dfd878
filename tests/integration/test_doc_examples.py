"""Every example in the README and docs/ runs as pasted, against a real stack (API, worker,
Redis, model).

Shell lines run with bash in a scratch directory; the only change made to them is the address:
`localhost:8080` becomes the test stack's port, and `.venv/bin/` the suite's own venv. A line
that cannot run inside the suite is listed in NOT_RUN_HERE with the reason; a line that is
neither run nor listed fails the suite, so a new example is run or explained.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import redis

from tests.harness import REPO, Stack, settings_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

# Prefix of a README line -> why the suite does not run it.
NOT_RUN_HERE = {
    "make run": "starts the whole stack in the foreground; tests/integration/test_up.py runs it",
    "make test": "is what CI runs: the suite itself",
    "make lint": "ruff and mypy, run by developers before they commit",
    "make bench": "takes hours; writes docs/BENCHMARKS.md",
    "make soak": "takes minutes and a 30 s Redis outage; writes docs/SOAK.md",
    ".venv/bin/python -m bench.run": "runs models for many minutes; writes docs/BENCHMARKS.md",
}


def blocks(language: str) -> list[str]:
    return [
        body for doc in DOCS for lang, body in BLOCK.findall(doc.read_text()) if lang == language
    ]


def shell_lines() -> list[str]:
    lines = [line.strip() for body in blocks("sh") for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def runnable(line: str) -> bool:
    return not any(line.startswith(prefix) for prefix in NOT_RUN_HERE)


def test_every_shell_line_is_run_or_explained() -> None:
    for line in shell_lines():
        known = line.startswith(("granary ", ".venv/bin/granary ", "curl "))
        assert known or not runnable(line), f"example neither run here nor explained: {line}"


def _pasted(line: str, stack: Stack) -> str:
    venv_bin = str(Path(sys.executable).parent)
    line = line.replace("localhost:8080", f"127.0.0.1:{stack.settings.api.port}")
    return line.replace(".venv/bin/", f"{venv_bin}/")


def _run(line: str, stack: Stack, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = settings_env(stack.settings)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", _pasted(line, stack)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_shell_examples_run_as_pasted(stack_factory: Callable[..., Stack], tmp_path: Path) -> None:
    # The examples run as pasted; the server caps answers that name no max_tokens shorter
    # than its default of 256, which would only cost time here.
    stack = stack_factory(jobs={"default_max_tokens": 24})
    (tmp_path / "question.txt").write_text("Name one colour.")
    fixtures = REPO / "tests" / "fixtures" / "normalize"
    (tmp_path / "page.html").write_text((fixtures / "hotel.html").read_text())
    (tmp_path / "notes.md").write_text((fixtures / "guide.md").read_text())
    ran = 0
    for line in filter(runnable, shell_lines()):
        result = _run(line, stack, tmp_path)
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        assert result.stdout.strip(), line
        if line.startswith("curl "):
            assert orjson.loads(result.stdout)["status"] == "queued"
        if "--wait" in line:
            assert orjson.loads(result.stdout)["status"] == "finished"
        ran += 1
    # submit twice, curl, two document commands in README; three in FEATURES; six cache commands
    assert ran >= 14


def test_python_examples_run_as_pasted(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory()
    examples = blocks("python")
    port = stack.settings.api.port
    for code in examples:
        exec(code.replace("127.0.0.1:8080", f"127.0.0.1:{port}"), {})
    # Each asks one question: one finished job each.
    jobs = redis.Redis.from_url(stack.settings.redis_url).keys("granary:job:*[0-9a-f]")
    assert len(jobs) == len(examples) >= 1
