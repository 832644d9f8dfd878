"""CSV and TSV into one table block, with the standard library's csv module (quoting, embedded
separators and newlines). The first row is the header.
"""

from __future__ import annotations

import csv
import io

from shared.normalize.blocks import Block
from shared.normalize.cleanup import inline


def delimited_rows(text: str, delimiter: str) -> list[list[str]]:
    """The rows, cells cleaned, blank rows left out; csv.Error for malformed quoting."""
    reader = csv.reader(
        io.StringIO(text.lstrip("\ufeff"), newline=""), delimiter=delimiter, strict=True
    )
    return [[inline(cell) for cell in row] for row in reader if any(cell.strip() for cell in row)]


def delimited_blocks(text: str, delimiter: str) -> list[Block]:
    rows = delimited_rows(text, delimiter)
    if not rows:
        return []
    return [Block("table", header=tuple(rows[0]), rows=tuple(tuple(r) for r in rows[1:]))]
