"""The simulator room's shared fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_trace import trace_path


@pytest.fixture(scope="session")
def mooncake_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared Mooncake trace, or one of its format and shape (support/mooncake_trace.py):
    the tests that replay a trace never skip for want of it."""
    return trace_path(tmp_path_factory.mktemp("trace"))
