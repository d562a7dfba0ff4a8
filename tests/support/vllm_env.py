"""The environment vLLM (0.32 to 0.34) needs on a CPU-only machine without a network, for the tests
and benchmarks that import it: no device inference, an offline hub, and a fake Hugging Face
cache with the model configs the schedulers are built from (testing/vllm_suite)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from vllm_suite import hf_cache


def prepare() -> None:
    """Set the variables (unless already set) and write the fake cache once per process."""
    if os.environ.get("PAGEDKV_VLLM_ENV_READY"):
        return
    home = os.environ.get("HF_HOME")
    if home is None or not (Path(home) / "hub").is_dir():
        home = tempfile.mkdtemp(prefix="pagedkv-hf-")
        hf_cache.write(Path(home))
    os.environ["HF_HOME"] = home
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch

        # vLLM 0.34 refuses an x86 CPU whose Triton has no active driver ("vLLM on x86
        # CPUs requires Triton (triton-cpu)") unless CUDA_VISIBLE_DEVICES is empty, its
        # case of a distributed worker; vllm_suite.run sets it so too. Only where torch
        # sees no CUDA device: GPU tests in the same process keep theirs.
        if not torch.cuda.is_available():
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["PAGEDKV_VLLM_ENV_READY"] = "1"


__all__ = ["prepare"]
