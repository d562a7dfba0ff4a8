"""Probes for changes the lead developer is making outside the inputs branch (the core's
batch error order, hit counters restarting on reset, the binding mapping
the core's NotSwapped to SequenceNotSwappedError). Each asks the built extension whether it
has the change. Tests that need a change are expected to fail (strictly) only while its probe
says it is missing, so they run as ordinary tests once it lands; then this module and its uses
can go.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pagedkv


def _probe(f: Callable[[Any], Any], want: Any) -> bool:
    m = pagedkv.BlockManager(8, 1, num_cpu_blocks=4)
    m.allocate(0, [1])
    m.allocate(1, [1, 2])
    m.swap_out(1)
    try:
        return bool(f(m) == want)
    except Exception as e:
        return type(e) is want


def _reset_then_queries(m: Any) -> int:
    m.free(0)
    m.reset_prefix_cache()
    return int(m.stats().prefix_queries)


HAS_NOT_SWAPPED = _probe(lambda m: m.swap_in(0), pagedkv.SequenceNotSwappedError)
ORDERS_BATCHES = _probe(
    lambda m: m.append_batch([1, 7], [0, 0]), pagedkv.SequenceSwappedError
) and _probe(lambda m: m.append_batch([7, 0, 0], [0, 0, 0]), pagedkv.InvalidArgumentError)
RESETS_HIT_COUNTERS = _probe(_reset_then_queries, 0)
