"""Speculative decoding (opt-in): drafts from n-grams and past outputs, verified in one pass.

Inside: `sources` (n-gram drafts from the prompt and output), `archive` (past outputs on disk),
`control` (draft length and on/off by measured speed), `decoder` (one job's verification
loop), `drafting` (an extraction's questions drafted together), `near_tie` (when a batched
greedy choice is decided again alone) and `speculator` (the per-worker wiring). Imports run
one way: the rest of the worker imports this package; nothing here imports the engine or
the multi-sequence decoder.
"""

from __future__ import annotations

from worker.speculation.archive import DraftArchive
from worker.speculation.drafting import Drafting
from worker.speculation.speculator import Speculator, drafting_report, drafts

__all__ = ["DraftArchive", "Drafting", "Speculator", "drafting_report", "drafts"]
