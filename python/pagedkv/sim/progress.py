"""Progress on stderr: a tiny bar redrawn at most ten times a second (`ProgressBar`), and the
lines of several runs at once, a plain line a minute when the stream is not a terminal
(`RunLines`, the sizing runs)."""

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


def clock(seconds: float) -> str:
    """`2m10s`, `45s`, `1h02m`."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RunLines:
    """Progress of several runs at once, on one stream, as `[sizing] LABEL: done/total
    requests, 2m10s`. On a terminal: one line redrawn (at most ten times a second) with every
    active run; elsewhere (a log file, a pipe): a plain line per run at most every `every`
    seconds, and one when each run starts and ends. `note` prints a line of its own."""

    def __init__(
        self, stream: TextIO, *, tty: bool, every: float = 60.0, prefix: str = "[sizing]"
    ) -> None:
        self.stream = stream
        self.tty = tty
        self.every = every
        self.prefix = prefix
        self.t0 = time.perf_counter()
        self._runs: dict[str, tuple[float, int, int]] = {}  # label -> (start, done, total)
        self._last: dict[str, float] = {}  # label -> when its last line was printed
        self._drawn = 0.0
        self._width = 0  # of the redrawn line, to blank it

    def _line(self, text: str) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(f"{self.prefix} {text}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self._line(text)
        self._redraw(time.perf_counter(), force=True)

    def start(self, label: str) -> None:
        now = time.perf_counter()
        self._runs[label] = (now, 0, 0)
        self._last[label] = now
        if not self.tty:
            self._line(f"{label}: started")
        self._redraw(now, force=True)

    def update(self, label: str, done: int, total: int) -> None:
        now = time.perf_counter()
        start = self._runs.get(label, (now, 0, 0))[0]
        self._runs[label] = (start, done, total)
        if self.tty:
            self._redraw(now)
        elif now - self._last.get(label, start) >= self.every:
            self._last[label] = now
            self._line(f"{label}: {done}/{total} requests, {clock(now - start)}")

    def end(self, label: str, text: str) -> None:
        now = time.perf_counter()
        start = self._runs.pop(label, (now, 0, 0))[0]
        self._last.pop(label, None)
        self._line(f"{label}: {text} ({clock(now - start)})")
        self._redraw(now, force=True)

    def _redraw(self, now: float, *, force: bool = False) -> None:
        if not self.tty or not self._runs or (not force and now - self._drawn < 0.1):
            return
        self._drawn = now
        parts = [
            f"{label} {done}/{total} {clock(now - start)}"
            for label, (start, done, total) in self._runs.items()
        ]
        text = f"{self.prefix} " + " | ".join(parts)
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """End a redrawn line."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


__all__ = ["ProgressBar", "RunLines", "clock"]
