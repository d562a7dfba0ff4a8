"""tests/events: KV events on vLLM's wire (pagedkv.kv_events), decoded by vLLM 0.33's own
event classes."""

from __future__ import annotations

import vllm_env

vllm_env.prepare()
