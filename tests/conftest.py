"""Set up once per pytest process, before any room's conftest imports an engine.

vLLM and SGLang both import huggingface_hub, which reads HF_HOME and HF_HUB_OFFLINE once, at
import: whichever engine a room imports first fixes them for the whole process. So the
offline hub and the fake model cache of `vllm_env` are in place before the first room is
collected (tests/sglang imports SGLang in its conftest, ahead of tests/vllm alphabetically).
"""

from __future__ import annotations

import vllm_env

vllm_env.prepare()
