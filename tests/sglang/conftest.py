"""tests/sglang: pagedkv's tiers as an SGLang 0.5.23 HiCache storage backend, driven through
SGLang's own classes (its host memory pool and its backend factory) on the CPU.

Skipped only where SGLang is not installed at all (CI installs it: .ci/run,
.ci/sglang-requirements.txt). An SGLang that is installed but cannot import (a dependency
missing) fails the tests instead of skipping them.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.importorskip("sglang", reason="SGLang 0.5.23 is not installed")
