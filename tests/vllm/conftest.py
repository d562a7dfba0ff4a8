"""tests/vllm: pagedkv inside vLLM 0.33 (pagedkv.vllm), with vLLM's own code installed."""

from __future__ import annotations

import vllm_env

vllm_env.prepare()
