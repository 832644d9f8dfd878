"""Token bytes to text pieces: incremental UTF-8 and stop sequences.

A token can end in the middle of a UTF-8 character, and a stop sequence can span tokens, so
text is released only once it can no longer turn out to be part of either.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field


@dataclass
class TextStream:
    stop: list[str]
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    _pending: str = ""
    text: str = ""
    stopped: bool = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; returns the text now safe to release (may be empty)."""
        self._pending += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release whatever is held back."""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
        elif final:
            out, self._pending = self._pending, ""
        else:
            keep = self._held_back()
            split = len(self._pending) - keep
            out, self._pending = self._pending[:split], self._pending[split:]
        self.text += out
        return out

    def _first_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of pending text that starts some stop sequence."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(s[:n]):
                    longest = n
                    break
        return longest
