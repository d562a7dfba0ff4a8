"""What the commands' options accept, apart from the runs behind them: defining `simulate`'s
options (for every command, `--mrc-only` included) imports this module and none of the
ablation's, the cluster's or the tiers' runs. `tests/sim/test_sim_lean_imports.py` checks
that `ablate_claims.CLAIMS` names the claims of `CLAIM_NAMES`."""

from __future__ import annotations

# --ablate-block-sizes: each size at the same cache tokens
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
# --ablate-claims: `ablate_claims.CLAIMS`' keys, in order
CLAIM_NAMES = ("fork", "reclaim", "hot", "prefix", "lz4", "block-size")
# --cluster-tier
TIER_MODES = ("shared", "per-node", "off")
REMOTE_TTL = 3600.0  # seconds a run's entries live on a --remote server
# --tier-data
TIER_DATA = ("count", "real")
# --loop: which scheduling loop replays (`rust_loop`; docs/scheduling-loop.md)
LOOPS = ("auto", "python", "rust")
DEFAULT_MODEL = "llama-3-8b"  # whose KV bytes the tiers move when no model is given

__all__ = [
    "BLOCK_SIZES",
    "CLAIM_NAMES",
    "DEFAULT_MODEL",
    "LOOPS",
    "REMOTE_TTL",
    "TIER_DATA",
    "TIER_MODES",
]
