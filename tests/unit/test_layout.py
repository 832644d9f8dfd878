"""The layout is the architecture: imports run one way and the queue contract lives in one place.

shared/ holds what several processes use, so it imports no process package (api, worker,
warmer) nor the command line on top of them; the processes do not import each other; queue
names are spelled only in shared/queues.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

from shared.queues import QUEUES
from tests.harness import REPO

PROCESS_PACKAGES = ("api", "worker", "warmer")


def _imports(package: str) -> list[tuple[str, str]]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(REPO)), node.module))
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(REPO)), alias.name) for alias in node.names]
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def test_shared_imports_no_process_package_nor_the_cli() -> None:
    upward = [(p, m) for p, m in _imports("shared") if _top(m) in (*PROCESS_PACKAGES, "cli")]
    assert upward == []


def test_processes_do_not_import_each_other_nor_the_cli() -> None:
    for package in PROCESS_PACKAGES:
        others = {*PROCESS_PACKAGES, "cli"} - {package}
        sideways = [(p, m) for p, m in _imports(package) if _top(m) in others]
        assert sideways == [], package


def _queue_literals(path: Path) -> list[str]:
    """Queue names written as literals where a queue is meant: arguments of the calls that
    take one, and `queue_name=`. ("batch" and "warm" are also commands and job kinds.)"""
    takes_queue = {"queue", "enqueue", "Queue", "create", "submit", "failed"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        values = [kw.value for kw in node.keywords if kw.arg == "queue_name"]
        if name in takes_queue:
            values += node.args
        found += [v.value for v in values if isinstance(v, ast.Constant) and v.value in QUEUES]
    return found


def test_queue_names_are_spelled_only_in_shared_queues() -> None:
    spelled = [
        (str(path.relative_to(REPO)), name)
        for package in (*PROCESS_PACKAGES, "shared", "cli")
        for path in (REPO / package).rglob("*.py")
        if path != REPO / "shared" / "queues.py"
        for name in _queue_literals(path)
        + (["interactive"] if '"interactive"' in path.read_text() else [])
    ]
    assert spelled == []
