"""Everything in pagedkv.vllm that differs between the vLLM releases it serves: one entry per
release series, in one place.

pagedkv.vllm serves vLLM 0.32, 0.33 and 0.34 (0.32.0, 0.33.0 and 0.34.0 are the releases
tested). Importing this module checks the installed vLLM and raises `ImportError` for any
other, naming it and the supported ones, before anything else of vLLM is imported. A new
release costs an entry in `RELEASES` (with functions here only where its behaviour
differs), its pinned interface in protocol.py and its pin in testing/vllm_suite/pins.py
(docs/vllm.md, "Supported vLLM releases").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import vllm

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Release:
    """How one vLLM release series asks the questions the adapter answers."""

    series: str  # "0.34": every 0.34.x release is served by this entry
    tested: str  # the release whose interface is pinned and whose tests run ("0.34.0")
    # Whether the request may read the local prefix cache at all.
    lookup_enabled: Callable[[Request], bool]
    # The longest prefix hit the request allows, given the caller's bound (None: no bound).
    max_hit_length: Callable[[Request, int | None], int]
    # Whether the scheduler's `update_from_output` calls `cache_blocks` at a running
    # request's processed tokens after a step with drafts or output placeholders (0.33 on).
    # That call is where pagedkv learns the tokens computed in draft or placeholder slots;
    # without it (0.32) the manager takes them in before releasing a window's blocks.
    caches_after_output: bool


# -- 0.32 and 0.33 --------------------------------------------------------------------------
def _lookup_enabled_skip_flag(request: Request) -> bool:
    # `skip_reading_prefix_cache`: set from the sampling or pooling parameters.
    return not request.skip_reading_prefix_cache


def _max_hit_length_last_token(request: Request, bound: int | None) -> int:
    # The last token is always computed (its logits); a caller's bound replaces that cap.
    return request.num_tokens - 1 if bound is None else bound


# -- 0.34 -----------------------------------------------------------------------------------
def _lookup_enabled_hit_limit(request: Request) -> bool:
    # 0.34 replaced the flag with `prefix_cache_hit_limit`: 0 when the request skips cache
    # reads, the first scored prompt row when it asks for prompt logprobs, None unbounded.
    limit = request.prefix_cache_hit_limit  # type: ignore[attr-defined, unused-ignore]
    return bool(limit != 0)


def _max_hit_length_hit_limit(request: Request, bound: int | None) -> int:
    # min(num_tokens - 1, prefix_cache_hit_limit, bound): a bound can only lower the limit,
    # so a request scoring its prompt from row k reads at most k tokens from the cache.
    return int(request.get_max_cache_hit_length(bound))  # type: ignore[attr-defined, unused-ignore]


RELEASES = {
    "0.32": Release("0.32", "0.32.0", _lookup_enabled_skip_flag, _max_hit_length_last_token, False),
    "0.33": Release("0.33", "0.33.0", _lookup_enabled_skip_flag, _max_hit_length_last_token, True),
    "0.34": Release("0.34", "0.34.0", _lookup_enabled_hit_limit, _max_hit_length_hit_limit, True),
}


def release_of(version: str) -> Release:
    """The entry serving vLLM `version` ("0.34.0", "0.32.0+cpu", "0.34.1rc1"), or an
    `ImportError` that names it and the supported releases."""
    match = re.match(r"(\d+)\.(\d+)(?:\.|$)", version)
    found = RELEASES.get(f"{match.group(1)}.{match.group(2)}") if match else None
    if found is None:
        supported = ", ".join(f"{r.series}.x" for r in RELEASES.values())
        raise ImportError(
            f"pagedkv.vllm supports vLLM {supported} (tested: "
            f"{', '.join(r.tested for r in RELEASES.values())}); vLLM {version} is installed"
        )
    return found


# The installed vLLM's entry: importing pagedkv.vllm fails here for any other vLLM.
RELEASE = release_of(str(vllm.__version__))

__all__ = ["RELEASE", "RELEASES", "Release", "release_of"]
