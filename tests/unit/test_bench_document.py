"""docs/BENCHMARKS.md is rewritten a section at a time: each section keeps its own date."""

from __future__ import annotations

from bench.run import HEADER, _replaced, _stamped

MEASURED_ON = "- Date: 2026-12-05 10:00 UTC\n- Machine: a host\n"
OLD = (
    "# Benchmarks\n\nan older header\n\n"
    "## Alpha\n\n- Date: 2026-12-01 09:00 UTC\n\nalpha's table\n\n"
    "## Beta\n\n- Date: 2026-12-02 09:00 UTC\n\nbeta's table\n"
)


def test_a_section_is_stamped_under_its_title() -> None:
    assert _stamped("## Beta\n\nnew table\n\n", MEASURED_ON) == (
        "## Beta\n\n- Date: 2026-12-05 10:00 UTC\n- Machine: a host\n\nnew table\n"
    )


def test_a_suite_replaces_its_own_section_and_no_other() -> None:
    new = _stamped("## Beta\n\nnew table\n", MEASURED_ON)
    text = _replaced(OLD, [new])
    assert text.startswith(HEADER)  # the header says each section has its own date
    assert "an older header" not in text
    assert "## Alpha\n\n- Date: 2026-12-01 09:00 UTC\n\nalpha's table\n" in text
    assert "beta's table" not in text and text.endswith(new)
    # A new suite's section is appended.
    gamma = _stamped("## Gamma\n\ngamma's table\n", MEASURED_ON)
    assert _replaced(text, [gamma]) == text + "\n" + gamma
