"""The thread rooms' shared fixture."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def fast_thread_switches() -> Iterator[None]:
    """Switch threads far more often than the default 5 ms, to interleave more."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)
