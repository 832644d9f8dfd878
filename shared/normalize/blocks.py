"""The document as every input type reads into it: headings, paragraphs, list items,
label-value pairs and tables, in order. The formats are renderings of these blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BlockKind = Literal["heading", "paragraph", "item", "pair", "table"]
# Why a parser would leave a block out; it stays if it holds a fact (see `guard`), except a
# page number ("Page 2 of 9" at the edge of pages with running headers): that numbers the
# layout, not anything the document says, so it is neither restored nor checked.
DropReason = Literal["furniture", "header_footer", "page_number"]


@dataclass(frozen=True, slots=True)
class Block:
    kind: BlockKind
    # heading, paragraph, item: the text; pair: the value.
    text: str = ""
    # pair: the label.
    label: str = ""
    # table: column headers (may be empty) and rows of cells.
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    drop: DropReason | None = None

    def units(self) -> list[str]:
        """The texts the parser read, one per cell or line: what the self-check protects."""
        if self.drop == "page_number":
            return []
        if self.kind == "table":
            return [cell for row in (self.header, *self.rows) for cell in row if cell]
        if self.kind == "pair":
            return [self.label, self.text]
        return [self.text]
