"""`ModelRunnerOutput` as the tests' fake model runner returns it, under each supported vLLM
release: up to 0.33 it carries `req_id_to_index`, which 0.34 dropped (the scheduler derives
it from `req_ids`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.outputs import ModelRunnerOutput

_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], **fields: Any
) -> ModelRunnerOutput:
    """One step's output: `sampled_token_ids[i]` sampled for `req_ids[i]`, no logprobs, no
    pooling, plus `fields` (a connector's output, say)."""
    if _HAS_INDEX:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled_token_ids,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **fields,
    )


__all__ = ["runner_output"]
