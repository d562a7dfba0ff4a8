"""tests/router: the KV-aware router index (pagedkv.router), fed by pagedkv's and vLLM 0.33's
own publishers and compared with Dynamo's index."""

from __future__ import annotations

import vllm_env

vllm_env.prepare()
