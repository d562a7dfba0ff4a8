"""A tiny progress bar on a text stream (stderr by default), redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`bar(done, total)` redraws `label [####....] done/total unit elapsed`; `close()` ends it."""

    def __init__(
        self,
        label: str = "",
        *,
        unit: str = "requests",
        width: int = 30,
        stream: TextIO | None = None,
        interval: float = 0.1,
    ) -> None:
        self.label = label
        self.unit = unit
        self.width = width
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self.start = time.perf_counter()
        self._last = -1.0
        self._state = (0, 0)

    def __call__(self, done: int, total: int) -> None:
        self._state = (done, total)
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        done, total = self._state
        frac = done / total if total else 1.0
        filled = min(self.width, int(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        prefix = f"{self.label} " if self.label else ""
        self.stream.write(
            f"\r{prefix}[{bar}] {done}/{total} {self.unit} {frac:4.0%}  {now - self.start:6.1f} s"
        )
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()


__all__ = ["ProgressBar"]
