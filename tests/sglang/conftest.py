"""tests/sglang: pagedkv's tiers as an SGLang 0.5.23 HiCache storage backend, driven through
SGLang's own classes (its host memory pool and its backend factory) on the CPU.

Each test module skips where SGLang is not installed at all (`pytest.importorskip`; CI
installs it: .ci/run, .ci/sglang-requirements.txt). An SGLang that is installed but cannot
import (a dependency missing) fails here instead, loudly, rather than being skipped.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("sglang") is not None:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
