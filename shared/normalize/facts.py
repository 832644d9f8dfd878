"""Blocks into `facts`: one fact per line as "label: value".

- "label: value" lines and definition lists stay as they are;
- a table row becomes its cells, each with its column header ("Room: Double; Price: 120 EUR");
  without headers the first cell labels the rest;
- a paragraph is split into sentences; one carrying a number, date, price, duration, phone,
  email, URL, ID, negation or condition is kept, labelled with its heading; the others
  (filler) are dropped;
- list items are kept (short, and facts more often than not), labelled with their heading.

Headings become labels: "Rates > Room: Double; Price: 120 EUR", "Policies: No pets allowed.".
"""

from __future__ import annotations

from shared.normalize.blocks import Block
from shared.normalize.entities import carries_fact
from shared.normalize.plain import pair
from shared.normalize.render import Line, mark_duplicates
from shared.normalize.sentences import language, sentences


def facts_lines(blocks: list[Block]) -> list[Line]:
    lines: list[Line] = []
    heading = ""
    section = 0
    lang = language(" ".join(b.text for b in blocks if b.kind == "paragraph")[:20_000])
    for block in blocks:
        if block.kind == "heading":
            heading, section = block.text, section + 1
            if block.text:
                lines.append(Line(block.text, section, block.drop or "heading"))
            continue
        for text, drop in _facts(block, heading, lang):
            lines.append(Line(text, section, block.drop or drop))
    return mark_duplicates(lines)


def _facts(block: Block, heading: str, lang: str) -> list[tuple[str, str | None]]:
    scope = f"{heading} > " if heading else ""
    if block.kind == "pair":
        return [(scope + block.labelled(), None)]
    if block.kind == "table":
        return [(scope + _row(block.header, row), None) for row in block.rows] or [
            (scope + "; ".join(block.header), None)
        ]
    found = pair(block.text)
    if found is not None:
        return [(f"{scope}{found[0]}: {found[1]}", None)]
    label = f"{heading}: " if heading else ""
    if block.kind == "item":
        return [(label + block.text, None)]
    return [
        (label + sentence, None if carries_fact(sentence) else "filler")
        for sentence in sentences(block.text, lang)
    ]


def _row(header: tuple[str, ...], row: tuple[str, ...]) -> str:
    if not header:
        first, *rest = row
        if not first:
            return "; ".join(cell for cell in rest if cell)
        values = "; ".join(cell for cell in rest if cell)
        return f"{first}: {values}" if values else first
    cells = []
    for n, cell in enumerate(row):
        if not cell:
            continue
        name = header[n] if n < len(header) else ""
        cells.append(f"{name}: {cell}" if name else cell)
    return "; ".join(cells)
