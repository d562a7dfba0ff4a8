"""Which device the kernel tests of every room can run on."""

from __future__ import annotations


def cuda_ok() -> bool:
    """Whether the "cuda" backend can run here: a CUDA device that torch and CuPy both see."""
    try:
        import cupy
        import torch

        return bool(torch.cuda.is_available() and cupy.is_available())
    except Exception:
        return False
