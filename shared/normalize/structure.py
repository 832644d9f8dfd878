"""Structure the blocks of any input type hold without markup saying so, read from their
words and order (a web page copied as text, or HTML whose headings are `<strong>`):

- a dense run ("Via Roma 12, Verona — VAT 0123 — Sales +39 045 … — PEC a@b.it") is one fact
  per piece;
- a menu or breadcrumb written as text names pages ("navigation"), a copyright line is
  boilerplate;
- a question is one line with its answer ("After 24 hours." says nothing alone);
- a short title-like line before values it labels ("Oak parquet" above "Price: € 45 per m²")
  is their heading, so each value keeps its subject.
"""

from __future__ import annotations

import re
from dataclasses import replace

from shared.normalize import boilerplate
from shared.normalize.blocks import Block
from shared.normalize.entities import entities
from shared.normalize.plain import MAX_ANSWER_WORDS, is_question, looks_like_heading, pair

# An em or en dash, a bar, a middle dot or a bullet, spaced, between the pieces of a run.
_RUN_SEPARATOR = re.compile(r"\s+[\u2014\u2013|·•]\s+")
_MIN_RUN_PIECES = 3
_MAX_PIECE_WORDS = 12
_REGIONS = ("header", "footer", "aside")


def structured(blocks: list[Block]) -> list[Block]:
    runs = [piece for block in blocks for piece in _run_pieces(block)]
    template = [_as_template(block) for block in runs]
    return _leads_as_headings(_questions_with_answers(template))


def _run_pieces(block: Block) -> list[Block]:
    """A dense run's pieces, each a block of its own: a pair when it reads "label: value",
    else a list item (a run is a list: "Oakline Floors Ltd" in a footer's run is no filler);
    any other block as it is."""
    if block.kind not in ("paragraph", "item", "pair"):
        return [block]
    pieces = _RUN_SEPARATOR.split(block.labelled() if block.kind == "pair" else block.text)
    if len(pieces) < _MIN_RUN_PIECES or not all(_run_piece(piece) for piece in pieces):
        return [block]
    out = []
    for piece in pieces:
        found = pair(piece)
        if found is None:
            out.append(Block("item", piece, drop=block.drop))
        else:
            out.append(Block("pair", found[1], label=found[0], drop=block.drop))
    return out


def _run_piece(piece: str) -> bool:
    """A piece of a run: short, and a name (a capital first) or a value. A lower-case start
    without a value means a sentence that an aside interrupts ("The floor — laid by us —
    lasts."); one word is a range's end ("Mon \u2013 Fri"), unless it is a value ("info@x.it")."""
    words = piece.split()
    if not words or len(words) > _MAX_PIECE_WORDS:
        return False
    valued = bool(entities(piece))
    return (piece[0].isupper() or valued) and (len(words) > 1 or valued)


def _as_template(block: Block) -> Block:
    """A menu or breadcrumb line is navigation; a copyright line (alone, or a run's piece) is
    boilerplate."""
    if block.kind == "table" or block.drop is not None:
        return block
    if boilerplate.is_menu(block.text):
        return replace(block, drop="navigation")
    if boilerplate.is_copyright(block.text):
        return replace(block, drop="boilerplate")
    return block


def _questions_with_answers(blocks: list[Block]) -> list[Block]:
    """A question and what answers it become one pair: a question line with the paragraph
    or list item after it; a question heading with its section, when that is all paragraphs
    and items (else the blocks after the answer would lose their heading). A question whose
    answer is long heads it instead."""
    out: list[Block] = []
    i = 0
    while i < len(blocks):
        question = blocks[i]
        end = i + 1
        if _asks(question):
            last = len(blocks) if question.kind == "heading" else min(i + 2, len(blocks))
            while end < last and _answers(blocks[end]):
                end += 1
        answer = blocks[i + 1 : end]
        if not answer:
            out.append(question)
            i += 1
            continue
        whole = question.kind != "heading" or _section_ends(blocks, end)
        if whole and sum(len(b.text.split()) for b in answer) <= MAX_ANSWER_WORDS:
            out.append(Block("pair", _joined(answer), label=question.text, drop=question.drop))
        else:
            out += [replace(question, kind="heading"), *answer]
        i = end
    return out


def _section_ends(blocks: list[Block], start: int) -> bool:
    """Nothing but dropped blocks (a banner, a menu) between `start` and the next heading."""
    for block in blocks[start:]:
        if block.kind == "heading":
            return True
        if block.drop is None:
            return False
    return True


def _asks(block: Block) -> bool:
    return block.kind in ("heading", "paragraph") and block.drop is None and is_question(block.text)


def _answers(block: Block) -> bool:
    return block.kind in ("paragraph", "item") and block.drop is None and not _asks(block)


def _joined(answer: list[Block]) -> str:
    """An answer's paragraphs as sentences of one line, its list items separated by "; "."""
    joined = answer[0].text
    for block in answer[1:]:
        joined += ("; " if block.kind == "item" else " ") + block.text
    return joined


def _leads_as_headings(blocks: list[Block]) -> list[Block]:
    """A lead (a short title-like paragraph: a product's name) above values it labels (pairs,
    a table, list items before the next heading or lead) becomes their heading. Not in a
    page region (a footer's "Rossi S.r.l." above its address lines is the footer's)."""
    out = list(blocks)
    region = False
    for n, block in enumerate(blocks):
        if block.kind == "heading":
            region = not block.text and block.label in _REGIONS
        elif not region and _is_lead(block) and _labels_values(blocks, n + 1):
            out[n] = Block("heading", block.text)
    return out


def _is_lead(block: Block) -> bool:
    """A paragraph that reads as a title (plain text's heading test), starts with a capital
    and introduces nothing itself (no closing colon, not "label: value")."""
    text = block.text
    return (
        block.kind == "paragraph"
        and block.drop is None
        and text[:1].isupper()
        and not text.endswith(":")
        and looks_like_heading(text)
        and pair(text) is None
    )


def _labels_values(blocks: list[Block], start: int) -> bool:
    for block in blocks[start:]:
        if block.kind == "heading" or _is_lead(block):
            return False
        if block.drop is None and (block.kind != "paragraph" or pair(block.text) is not None):
            return True  # a pair (or a "label: value" paragraph), a table, a list item
    return False
