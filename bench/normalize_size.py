"""Normalising a large document: the API normalises in the request path (up to 5,000,000
characters), so the time must grow with the document, not faster.

A generated hotel page (per room: a heading, a sentence with its price, a two-item list) as
HTML and as plain text, at three sizes, read as `facts` in process (no model); best of three
runs each. Linear growth: the seconds per MB stay level from row to row.
"""

from __future__ import annotations

import time

from shared.normalize import normalize

ROOMS = (500, 2_000, 8_000)
RUNS = 3


def html_page(rooms: int) -> str:
    sections = "".join(
        f"<div class='room'><h2>Room {n}</h2><p>Room {n} faces the garden and costs € {n} a "
        f"night. It is quiet.</p><ul><li>Wifi</li><li>Desk {n}</li></ul></div>"
        for n in range(rooms)
    )
    return f"<html><body><main><div>{sections}</div></main></body></html>"


def text_page(rooms: int) -> str:
    return "\n\n".join(
        f"Room {n}\nRoom {n} faces the garden and costs € {n} a night. It is quiet.\n"
        f"- Wifi\n- Desk {n}"
        for n in range(rooms)
    )


def seconds(text: str) -> float:
    best = float("inf")
    for _ in range(RUNS):
        started = time.perf_counter()
        result = normalize(text, "facts")
        best = min(best, time.perf_counter() - started)
        assert result.used == "facts" and not result.missing
    return best


def section() -> str:
    rows = []
    for rooms in ROOMS:
        for kind, page in (("HTML", html_page(rooms)), ("plain text", text_page(rooms))):
            took = seconds(page)
            mb = len(page.encode()) / 1e6
            rows.append(f"| {kind} | {rooms:,} | {mb:.2f} | {took:.2f} | {took / mb:.2f} |")
    return "\n".join(
        [
            "## Normalising a large document",
            "",
            __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            "",
            "| input | rooms | MB | seconds | seconds per MB |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
