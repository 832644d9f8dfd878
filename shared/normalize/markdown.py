"""Markdown into blocks, with markdown-it-py (CommonMark, plus GFM tables).

Soft line breaks are line breaks here: Markdown written as "Label: value" lines without blank
lines between them is common, and lines wrapped mid-sentence are joined back like plain text.
A link shows its absolute target after its text (URLs, emails and phones are facts).
"""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.token import Token

from shared.normalize.blocks import Block
from shared.normalize.cleanup import inline
from shared.normalize.html import html_blocks
from shared.normalize.plain import line_blocks

_PARSER = MarkdownIt("commonmark").enable("table")
_SHOWN_SCHEMES = ("http://", "https://", "mailto:", "tel:")


def markdown_blocks(text: str) -> list[Block]:
    tokens = _PARSER.parse(text)
    blocks: list[Block] = []
    items = 0  # list items open around the current token
    i = 0
    while i < len(tokens):
        token = tokens[i]
        items += {"list_item_open": 1, "list_item_close": -1}.get(token.type, 0)
        if token.type == "heading_open":
            blocks.append(Block("heading", inline(_inline_text(tokens[i + 1]))))
            i += 2
        elif token.type == "table_open":
            i = _table(tokens, i, blocks)
        elif token.type == "inline":
            lines = _inline_text(token).split("\n")
            found = line_blocks([inline(line) for line in lines if line.strip()], headings=False)
            blocks += [
                Block("item", b.text) if items and b.kind == "paragraph" else b for b in found
            ]
        elif token.type in ("fence", "code_block"):
            lines = [inline(line) for line in token.content.splitlines()]
            blocks += [Block("paragraph", line) for line in lines if line]
        elif token.type == "html_block":
            blocks += html_blocks(token.content)
        i += 1
    return blocks


def _table(tokens: list[Token], start: int, blocks: list[Block]) -> int:
    header: tuple[str, ...] = ()
    rows: list[tuple[str, ...]] = []
    row: list[str] = []
    in_head = False
    i = start
    while tokens[i].type != "table_close":
        kind = tokens[i].type
        if kind in ("thead_open", "thead_close"):
            in_head = kind == "thead_open"
        elif kind == "inline":
            row.append(inline(_inline_text(tokens[i])))
        elif kind == "tr_close":
            if in_head and not header:
                header = tuple(row)
            elif any(row):
                rows.append(tuple(row))
            row = []
        i += 1
    blocks.append(Block("table", header=header, rows=tuple(rows)))
    return i


def _inline_text(token: Token) -> str:
    parts: list[str] = []
    links: list[tuple[str, int]] = []
    for child in token.children or []:
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append("\n")
        elif child.type == "image":
            parts.append(child.content)
        elif child.type == "link_open":
            links.append((str(child.attrs.get("href") or ""), len(parts)))
        elif child.type == "link_close" and links:
            href, at = links.pop()
            parts.append(_shown_target(href, "".join(parts[at:])))
    return "".join(parts)


def _shown_target(href: str, text: str) -> str:
    if not href.startswith(_SHOWN_SCHEMES):
        return ""
    target = href.split(":", 1)[1] if href.startswith(("mailto:", "tel:")) else href
    return "" if target in text else f" ({target})"
