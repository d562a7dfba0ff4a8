"""What a block of KV cache weighs, so that block counts print as GiB too.

The plain simulation (no `--model` comparison) runs a manager without KV-cache groups: one
block holds `block_size` tokens of every layer's K and V. Its weight is `bytes per token x
block_size`, the bytes per token coming from `--kv-bytes-per-token N` or from a `--model`
preset whose layout is one full-attention group (a hybrid model's blocks weigh what its
groups make them weigh: that is the `--model` comparison's job, `sim.model_run`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.sim.models import GIB, get_model, model_layout


@dataclass(frozen=True, slots=True)
class KVBytes:
    """KV bytes per token (all layers, K and V), and where the figure came from."""

    bytes_per_token: int
    source: str  # a model name, or "--kv-bytes-per-token"

    def per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def gib(self, blocks: float, block_size: int) -> float:
        """GiB of `blocks` blocks of `block_size` tokens."""
        return blocks * self.per_block(block_size) / GIB

    def describe(self, block_sizes: list[int]) -> str:
        per = ", ".join(
            f"{self.per_block(bs) / (1 << 20):g} MiB per block of {bs}" for bs in block_sizes
        )
        return f"{self.bytes_per_token} bytes of KV per token ({self.source}): {per}"


def from_model(name: str) -> KVBytes:
    """The bytes per token of a preset whose KV cache is one full-attention group."""
    model = get_model(name)
    layout = model_layout(model)
    if layout.manager_groups is not None:
        raise ValueError(
            f"{name} has {len(layout.groups)} KV-cache groups ({layout.describe()}); --mrc and "
            "GiB figures size a cache of full-attention blocks: run --model without --mrc to "
            "compare its groups with all-full attention, or give --kv-bytes-per-token"
        )
    return KVBytes(model.full_kv_bytes_per_token, name)


def kv_bytes(model: str | None, bytes_per_token: int | None) -> KVBytes | None:
    """From `--model` or `--kv-bytes-per-token` (at most one); None when neither is given."""
    if model is not None and bytes_per_token is not None:
        raise ValueError("give either --model or --kv-bytes-per-token, not both")
    if bytes_per_token is not None:
        if bytes_per_token < 1:
            raise ValueError(f"--kv-bytes-per-token must be >= 1, got {bytes_per_token}")
        return KVBytes(bytes_per_token, "--kv-bytes-per-token")
    return from_model(model) if model is not None else None


__all__ = ["KVBytes", "from_model", "kv_bytes"]
