"""The pinned scheduler-facing interface against the installed vLLM and pagedkv's manager."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from pagedkv.vllm import KVCacheManager  # noqa: E402
from pagedkv.vllm.protocol import (  # noqa: E402
    ATTRIBUTES,
    VLLM_VERSION,
    SchedulerKVCacheManager,
)
from vllm_objects import VllmKVCacheManager, make_manager  # noqa: E402


def _methods() -> list[str]:
    return sorted(
        name
        for name, value in vars(SchedulerKVCacheManager).items()
        if (inspect.isfunction(value) or isinstance(value, property))
        and (not name.startswith("_") or name == "__init__")
    )


def _shape(fn: Any) -> list[tuple[str, Any, Any]]:
    """Parameter names, kinds and defaults: what a caller depends on."""
    if isinstance(fn, property):
        return [("<property>", None, None)]
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_installed_vllm_is_the_pinned_version() -> None:
    assert vllm.__version__ == VLLM_VERSION


@pytest.mark.parametrize("name", _methods())
def test_method_matches_vllm_and_pagedkv(name: str) -> None:
    pinned = _shape(vars(SchedulerKVCacheManager)[name])
    theirs = _shape(inspect.getattr_static(VllmKVCacheManager, name))
    ours = _shape(inspect.getattr_static(KVCacheManager, name))
    assert theirs == pinned, f"vLLM's {name} drifted from the pinned protocol"
    assert ours == pinned, f"pagedkv.vllm.KVCacheManager.{name} differs from the protocol"


def test_every_public_vllm_method_is_pinned_or_listed() -> None:
    """A method vLLM adds to its manager is either pinned here or known to be unused."""
    unused_by_the_scheduler: set[str] = set()
    public = {
        n
        for n, v in vars(VllmKVCacheManager).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }
    assert public - set(_methods()) - unused_by_the_scheduler == set()


@pytest.mark.parametrize("cls", [VllmKVCacheManager, KVCacheManager])
def test_attributes_exist(cls: type[Any]) -> None:
    manager = make_manager(cls, 64)
    for name in ATTRIBUTES:
        assert hasattr(manager, name), name
