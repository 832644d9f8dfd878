"""Never drop a fact: a line a rule would leave out is put back if it holds a value or a
negation that no output line holds, with the heading it is about. Of boilerplate (a consent
banner), only a phone or an email no output line holds brings a line back.
"""

from __future__ import annotations

from shared.normalize.blocks import LAYOUT, protected_values
from shared.normalize.entities import canonical, entities, negation_windows
from shared.normalize.render import Line


def guard(lines: list[Line]) -> list[Line]:
    """The lines to output, in order: those kept, and dropped ones restored for their facts."""
    kept = [line for line in lines if line.drop is None]
    have = {e for line in kept for e in entities(line.text)}
    text = canonical("\n".join(line.text for line in kept))
    for line in lines:
        if line.drop is None or line.drop in ("duplicate", "filler", *LAYOUT):
            # A duplicate's facts are in the line it repeats; filler has none by definition; a
            # page number numbers the layout, a menu link names a page.
            continue
        values = protected_values(line.text, line.drop)
        negated = [] if line.drop == "boilerplate" else negation_windows(line.text)
        if any(v not in have for v in values) or any(w not in text for w in negated):
            for restored in (line, line.subject):
                if restored is not None and restored.drop is not None:
                    restored.drop, restored.restored = None, True
                    have.update(entities(restored.text))
                    text = f"{text} {canonical(restored.text)}"
    return [line for line in lines if line.drop is None]
