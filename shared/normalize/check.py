"""The fact-preservation self-check, run on every normalisation: every value and negation
(with the words around it) the parser read must be in the output, each value with what it is
about.

It checks the result, not the rules, so a rule that rewrites or loses text by mistake is
caught too; `normalize` then falls back to a format that passes.
"""

from __future__ import annotations

from shared.normalize.entities import Values, entities, negation_windows
from shared.normalize.render import Line


def missing_facts(units: list[str], output: str) -> list[str]:
    """What `units` (the texts read from the input) hold that `output` lacks, in order."""
    out = Values(output)
    missing: dict[str, None] = {}
    checked: set[str] = set()
    for unit in units:
        for value in entities(unit):
            if value not in checked:
                checked.add(value)
                if not out.contains(value):
                    missing[value] = None
        for window in negation_windows(unit):
            if window not in out.text:
                missing[window] = None
    return list(missing)


def missing_subjects(output: list[Line]) -> list[str]:
    """Values output without what they are about: a line holding a value whose heading (its
    `subject`) is not output ("Price: € 45 per m²" without "Oak parquet")."""
    return [
        f"{line.subject.text} > {line.text}"
        for line in output
        if line.subject is not None and line.subject.drop is not None and entities(line.text)
    ]


def count_facts(units: list[str]) -> int:
    """Distinct values checked (what the result reports as checked)."""
    return len({value for unit in units for value in entities(unit)})
