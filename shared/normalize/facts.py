"""Blocks into `facts`: one fact per line as "label: value".

- "label: value" lines, definition lists and questions with their answers (a `<details>`
  block, a question line or heading with its answer: `structure`) stay as they are;
- a table row becomes its cells, each with its column header ("Room: Double; Price: 120 EUR");
  without headers the first cell labels the rest;
- a paragraph is split into sentences; one carrying a number, date, price, duration, phone,
  email, URL, ID, negation, condition or yes/no answer is kept, the others (filler) dropped,
  except under a heading that asks a question: all of its sentences answer it;
- list items are kept (short, and facts more often than not);
- the document's first heading is its title and stays, facts under it or not;
- an HTML footer's lines (the page's contact and legal data) are none of them filler, and
  they follow the title and its own lines, as a letterhead has them.

A label binds its value; a heading is a line of its own, once, above its section's lines. It
prefixes a line only where the line's label is under another heading too ("Double room >
Price: 120 EUR", "Single room > Price: 85 EUR"): there it tells the values apart. Repeating
every heading before every line made `facts` longer than `text` (rueckgabe.html: a 5-word
heading before each of 7 sentences that carry their own subject). Each line records its
heading as its `subject`: the check fails a value output without it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from shared.normalize.blocks import Block
from shared.normalize.entities import carries_fact
from shared.normalize.plain import pair
from shared.normalize.render import Line, mark_duplicates
from shared.normalize.sentences import language, sentences


class _Fact(NamedTuple):
    text: str
    drop: str | None
    scoped: bool  # prefixed with its heading (then the heading line is not needed for it)


def facts_lines(blocks: list[Block]) -> list[Line]:
    lines: list[Line] = []
    heading: Line | None = None
    section = 0
    lang = language(" ".join(b.text for b in blocks if b.kind == "paragraph")[:20_000])
    shared = _shared_labels(blocks)
    footer = titled = False
    footers: set[int] = set()
    title_line: Line | None = None
    for block in blocks:
        if block.kind == "heading":
            section += 1
            # The document's first heading is its title: what the page is about, and whose
            # the contact and legal data further down are. It stays with or without facts.
            first = bool(block.text) and not titled
            titled = titled or first
            heading = Line(block.text, section, block.drop or (None if first else "heading"))
            footer = block.label == "footer"
            if footer:
                footers.add(section)
            if first:
                title_line = heading
            if block.text:
                lines.append(heading)
            continue
        title = heading.text if heading is not None else ""
        scope = f"{title} > " if title and not shared.isdisjoint(_labels(block)) else ""
        # The heading is what the lines under it are about, unless the parser dropped it
        # (a breadcrumb, a banner's title): then it is no subject.
        about = heading if heading is not None and heading.drop in (None, "heading") else None
        # A footer's lines are the page's contact and legal data (who, where, how to reach
        # them), not prose: none of them is filler.
        for fact in _facts(block, scope, footer or title.endswith("?"), lang):
            line = Line(fact.text, section, block.drop or fact.drop)
            line.subject = None if fact.scoped or about is None or not about.text else about
            lines.append(line)
            if heading is not None and heading.drop == "heading" and not fact.scoped:
                heading.drop = None if line.drop is None else heading.drop
    return mark_duplicates(_letterhead(lines, footers, title_line))


def _letterhead(lines: list[Line], footers: set[int], title: Line | None) -> list[Line]:
    """A footer's lines (who, where, how to reach them, their legal IDs) moved up after the
    title and its own lines, as a letterhead has them: at the end of a page they come after
    everything a question could be confused with, and a small model looks for them there
    least."""
    moved = [line for line in lines if line.section in footers]
    rest = [line for line in lines if line.section not in footers]
    at = next((n + 1 for n, line in enumerate(rest) if line is title), 0)
    while at and at < len(rest) and title is not None and rest[at].section == title.section:
        at += 1  # the title's own lines (an introduction) stay with it
    return rest[:at] + moved + rest[at:]


def _labels(block: Block) -> set[str]:
    """What labels the block's values: a pair's label, a table's column headers (or first
    cells), a "label: value" paragraph's label."""
    if block.kind == "pair":
        return {block.label.casefold()}
    if block.kind == "table":
        names = block.header or tuple(row[0] for row in block.rows)
        return {name.casefold() for name in names if name}
    found = pair(block.text)
    return {found[0].casefold()} if found else set()


def _shared_labels(blocks: list[Block]) -> set[str]:
    """Labels found under more than one heading."""
    headings: defaultdict[str, set[str]] = defaultdict(set)
    heading = ""
    for block in blocks:
        if block.kind == "heading":
            heading = block.text
        for label in _labels(block):
            headings[label].add(heading)
    return {label for label, under in headings.items() if len(under) > 1}


def _facts(block: Block, scope: str, answers: bool, lang: str) -> list[_Fact]:
    """The block's lines; `answers`: its heading asks a question, so no sentence is filler."""
    scoped = bool(scope)
    if block.kind == "pair":
        return [_Fact(scope + block.labelled(), None, scoped)]
    if block.kind == "table":
        rows = [scope + _row(block.header, row) for row in block.rows]
        return [_Fact(row, None, scoped) for row in rows or [scope + "; ".join(block.header)]]
    found = pair(block.text)
    if found is not None:
        return [_Fact(f"{scope}{found[0]}: {found[1]}", None, scoped)]
    if block.kind == "item":
        return [_Fact(block.text, None, False)]
    return [
        _Fact(sentence, None if answers or carries_fact(sentence) else "filler", False)
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
