"""The Conclave: one worker serving many jobs at once (see loop.py)."""
