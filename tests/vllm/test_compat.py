"""pagedkv.vllm.compat: the vLLM releases served, the refusal of others at import, and the
per-release answers (who may read the prefix cache, and how far), each checked against the
installed vLLM's own manager on the same requests."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from pagedkv.vllm.compat import RELEASE, release_of  # noqa: E402
from vllm_objects import KVCacheManager, VllmKVCacheManager, make_manager  # noqa: E402

BS = 16
PROMPT = list(range(1000, 1070))  # 70 tokens: 4 full blocks


@pytest.mark.parametrize(
    ("version", "series"),
    [("0.32.0", "0.32"), ("0.32.0+cpu", "0.32"), ("0.33.0", "0.33"), ("0.34.0", "0.34"),
     ("0.34.1rc1", "0.34")],
)  # fmt: skip
def test_release_of_a_supported_version(version: str, series: str) -> None:
    assert release_of(version).series == series


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.35.0.dev12+gabc", "1.0.0", "x"])
def test_release_of_another_version_names_it_and_the_supported(version: str) -> None:
    with pytest.raises(ImportError) as info:
        release_of(version)
    message = str(info.value)
    assert f"vLLM {version} is installed" in message
    for supported in ("0.32.x", "0.33.x", "0.34.x", "0.32.0", "0.33.0", "0.34.0"):
        assert supported in message


def test_import_refuses_an_unsupported_vllm() -> None:
    """`import pagedkv.vllm` under a vLLM that reports 0.35.0 fails with the message, before
    the adapter's modules load."""
    code = (
        "import sys, vllm; vllm.__version__ = '0.35.0'\n"
        "try:\n    import pagedkv.vllm\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
        "    print('manager loaded:', 'pagedkv.vllm.manager' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "refused: pagedkv.vllm supports vLLM 0.32.x, 0.33.x, 0.34.x" in out
    assert "vLLM 0.35.0 is installed" in out
    assert "manager loaded: False" in out


def test_the_installed_vllm_is_served_by_its_own_entry() -> None:
    assert RELEASE.tested == str(vllm.__version__).split("+", 1)[0]


def test_caches_after_output_says_whether_the_scheduler_calls_cache_blocks() -> None:
    """The entry's `caches_after_output` is what the installed scheduler does: 0.33 and 0.34
    call `kv_cache_manager.cache_blocks` in `update_from_output` (where pagedkv takes in
    accepted drafts), 0.32 does not (the manager takes them in before releasing)."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    source = inspect.getsource(Scheduler.update_from_output)
    assert RELEASE.caches_after_output == ("self.kv_cache_manager.cache_blocks(" in source)


def _request(rid: str, **params: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(PROMPT),
        sampling_params=SamplingParams(max_tokens=8, ignore_eos=True, **params),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _warm(manager: Any) -> None:
    """PROMPT's four full blocks computed and freed: cached, unreferenced."""
    warm = _request("warm")
    assert manager.allocate_slots(warm, len(PROMPT)) is not None
    warm.num_computed_tokens = len(PROMPT)
    manager.free(warm)


# (sampling parameters, the hit the request may take) for the installed release.
CASES: list[tuple[dict[str, Any], int]] = [
    ({}, 64),
    ({"skip_reading_prefix_cache": True}, 0),
    ({"prompt_logprobs": 1}, 0),  # prompt logprobs skip cache reads by default
]
if RELEASE.series == "0.34":
    CASES += [
        # 0.34 scores prompt rows from prompt_logprob_start: the rows before it may be read.
        ({"prompt_logprobs": 1, "skip_reading_prefix_cache": False, "prompt_logprob_start": 40},
         32),
        ({"prompt_logprobs": 1, "skip_reading_prefix_cache": False}, 0),
    ]  # fmt: skip


@pytest.mark.parametrize(("params", "expected"), CASES)
@pytest.mark.parametrize("cls", [VllmKVCacheManager, KVCacheManager])
def test_prefix_cache_reads_follow_the_release(
    cls: type[Any], params: dict[str, Any], expected: int
) -> None:
    manager = make_manager(cls, 32, enable_caching=True)
    _warm(manager)
    request = _request("r", **params)
    assert manager.prefix_cache_lookup_enabled(request) == (expected > 0)
    blocks, hit, *_ = manager.get_computed_blocks(request)
    assert hit == expected
    assert len(blocks.get_block_ids()[0]) == expected // BS


# vLLM 0.32's lookup takes no bound; pagedkv's takes one under every release.
BOUNDED = [KVCacheManager] if RELEASE.series == "0.32" else [VllmKVCacheManager, KVCacheManager]


@pytest.mark.parametrize("cls", BOUNDED)
def test_a_callers_bound_lowers_the_hit(cls: type[Any]) -> None:
    manager = make_manager(cls, 32, enable_caching=True)
    _warm(manager)
    assert manager.get_computed_blocks(_request("r"), 40)[1] == 32


# vLLM's own probe exists from 0.34 on; pagedkv's manager has it under every release.
PROBES = [VllmKVCacheManager, KVCacheManager] if RELEASE.series == "0.34" else [KVCacheManager]


@pytest.mark.parametrize(("params", "expected"), CASES)
@pytest.mark.parametrize("cls", PROBES)
def test_num_cached_tokens_probes_without_taking(
    cls: type[Any], params: dict[str, Any], expected: int
) -> None:
    """0.34's probe: the cached prefix (all but the last token; 0 when the request may not
    read the cache, uncapped by a prompt-scoring start), with nothing taken or published."""
    manager = make_manager(cls, 32, enable_caching=True, enable_kv_cache_events=True)
    _warm(manager)
    manager.take_events()
    free = manager.block_pool.get_num_free_blocks()
    request = _request("r", **params)
    assert manager.get_num_cached_tokens(request) == (64 if expected else 0)
    assert manager.block_pool.get_num_free_blocks() == free
    assert manager.take_events() == []
    # Still a full hit afterwards: the probe touched nothing.
    assert manager.get_computed_blocks(_request("again"))[1] == 64
