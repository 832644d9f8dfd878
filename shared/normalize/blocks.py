"""The document as every input type reads into it: headings, paragraphs, list items,
label-value pairs and tables, in order. The formats are renderings of these blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.normalize.entities import contact_values, entities

BlockKind = Literal["heading", "paragraph", "item", "pair", "table"]
# Why a parser would leave a block out; it stays if it holds a fact (see `guard`), except a
# page number ("Page 2 of 9" at the edge of pages with running headers) and a navigation link's
# text ("Garden", "Cart (0)" in a site's menu): they number the layout or name a page, not
# anything the document says, so they are neither restored nor checked. Boilerplate (a consent
# banner, a newsletter box, a copyright line: `boilerplate`) is what the site's template says,
# not the document: its trackers, regulation numbers and cookie lifetimes are not facts of the
# page, only a phone or an email in it is (restored and checked if said nowhere else).
DropReason = Literal["furniture", "header_footer", "page_number", "navigation", "boilerplate"]
LAYOUT: frozenset[DropReason] = frozenset(["page_number", "navigation"])


def protected_values(text: str, drop: str | None) -> list[str]:
    """The values in `text` nothing may lose: all of them, but of boilerplate only phones and
    emails (what the check asks of a block, and what brings a dropped line back)."""
    return contact_values(text) if drop == "boilerplate" else entities(text)


@dataclass(frozen=True, slots=True)
class Block:
    kind: BlockKind
    # heading, paragraph, item: the text; pair: the value.
    text: str = ""
    # pair: the label; an HTML page region's empty heading: the region ("header", "footer",
    # "aside").
    label: str = ""
    # table: column headers (may be empty) and rows of cells.
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    drop: DropReason | None = None

    def labelled(self) -> str:
        """A pair as one line, "label: value"; a question and its answer as they read
        ("Can I return it in store? Yes, parcels.")."""
        joint = " " if self.label.endswith("?") else ": "
        return f"{self.label}{joint}{self.text}"

    def units(self) -> list[str]:
        """The texts the parser read, one per cell or line: what the self-check protects."""
        if self.drop in LAYOUT:
            return []
        if self.kind == "table":
            texts = [cell for row in (self.header, *self.rows) for cell in row if cell]
        elif self.kind == "pair":
            texts = [self.label, self.text]
        else:
            texts = [self.text]
        if self.drop == "boilerplate":
            return [value for text in texts for value in protected_values(text, self.drop)]
        return texts
