"""What the cluster options accept, apart from the runs: defining `simulate`'s options
(every command, `--mrc-only` included) imports this and none of the cluster's runs."""

from __future__ import annotations

TIER_MODES = ("shared", "per-node", "off")
REMOTE_TTL = 3600.0  # seconds a run's entries live on a --remote server

__all__ = ["REMOTE_TTL", "TIER_MODES"]
