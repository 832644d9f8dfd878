"""The fact-preservation self-check, run on every normalisation: every value and negation
(with the words around it) the parser read must be in the output.

It checks the result, not the rules, so a rule that rewrites or loses text by mistake is
caught too; `normalize` then falls back to a format that passes.
"""

from __future__ import annotations

from shared.normalize.entities import canonical, contains, entities, negation_windows


def missing_facts(units: list[str], output: str) -> list[str]:
    """What `units` (the texts read from the input) hold that `output` lacks, in order."""
    out = canonical(output)
    missing: dict[str, None] = {}
    checked: set[str] = set()
    for unit in units:
        for value in entities(unit):
            if value not in checked:
                checked.add(value)
                if not contains(out, value):
                    missing[value] = None
        for window in negation_windows(unit):
            if window not in out:
                missing[window] = None
    return list(missing)


def count_facts(units: list[str]) -> int:
    """Distinct values checked (what the result reports as checked)."""
    return len({value for unit in units for value in entities(unit)})
