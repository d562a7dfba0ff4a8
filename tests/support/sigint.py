"""Children that take Ctrl-C as a terminal would deliver it.

A process started in the background by a non-interactive shell (nohup, `cmd &` in a CI
script) ignores SIGINT, and its children inherit the ignoring across exec: Python then never
installs its KeyboardInterrupt handler, and a test that interrupts a child sees it run to the
end. While this context is open, the test process handles SIGINT (Python's default handler),
so a child started meanwhile gets the default disposition at exec, as at a terminal.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigint_default_in_children() -> Iterator[None]:
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
