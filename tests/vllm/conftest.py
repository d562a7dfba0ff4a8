"""tests/vllm: pagedkv.vllm inside vLLM 0.32, 0.33 or 0.34, with vLLM's own code installed."""

from __future__ import annotations

import vllm_env

vllm_env.prepare()
