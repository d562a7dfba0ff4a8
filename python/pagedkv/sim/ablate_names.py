"""What the ablation options accept, apart from the runs: defining `simulate`'s options
(every command, `--mrc-only` included) imports this and none of the ablation's runs.
`tests/sim/test_sim_lean_imports.py` checks that `ablate_claims.CLAIMS` names these claims."""

from __future__ import annotations

BLOCK_SIZES = (8, 16, 32, 64, 128, 256)  # the block-size rows: each at the same cache tokens
CLAIM_NAMES = ("fork", "reclaim", "hot", "prefix", "lz4", "block-size")  # CLAIMS' keys, in order

__all__ = ["BLOCK_SIZES", "CLAIM_NAMES"]
