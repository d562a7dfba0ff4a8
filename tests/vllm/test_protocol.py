"""The pinned scheduler-facing interface of each supported vLLM release, against the
installed vLLM (equal, or it drifted) and pagedkv's manager (callable the same way)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from pagedkv.vllm import KVCacheManager  # noqa: E402
from pagedkv.vllm.compat import RELEASE, RELEASES  # noqa: E402
from pagedkv.vllm.protocol import (  # noqa: E402
    ATTRIBUTES,
    PINNED,
    REMOVED,
    SchedulerKVCacheManager,
)
from vllm_objects import VllmKVCacheManager, make_manager  # noqa: E402

INSTALLED = str(vllm.__version__).split("+", 1)[0]  # "0.32.0+cpu" is the 0.32.0 release
Shape = list[tuple[str, Any, Any]]


def _methods(version: str) -> list[str]:
    """The methods pinned for `version`: its class and the classes it derives from."""
    names: set[str] = set()
    for klass in PINNED[version].__mro__:
        if klass.__module__ != "pagedkv.vllm.protocol":
            continue  # Protocol's and object's own
        names.update(
            name
            for name, value in vars(klass).items()
            if (inspect.isfunction(value) or isinstance(value, property))
            and (not name.startswith("_") or name == "__init__")
        )
    return sorted(names - REMOVED.get(version, frozenset()))


def _shape(fn: Any) -> Shape:
    """Parameter names, kinds and defaults: what a caller depends on."""
    if isinstance(fn, property):
        return [("<property>", None, None)]
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _pinned(version: str, name: str) -> Shape:
    return _shape(inspect.getattr_static(PINNED[version], name))


def _incompatible(ours: Shape, pinned: Shape) -> str | None:
    """Why a caller of the pinned shape cannot call `ours`, or None. Parameters without a
    default keep their positions; those with one are matched by name (vLLM's scheduler
    passes them by keyword), and a parameter only `ours` has must have a default."""
    required = [p for p in pinned if p[2] is inspect.Parameter.empty]
    if ours[: len(required)] != required:
        return f"required parameters {ours[: len(required)]} != {required}"
    by_name = {p[0]: p for p in ours}
    for p in pinned:
        if by_name.get(p[0]) != p:
            return f"{p} is {by_name.get(p[0])} here"
    names = {p[0] for p in pinned}
    for p in ours:
        if (
            p[0] not in names
            and p[2] is inspect.Parameter.empty
            and p[1]
            not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            )
        ):
            return f"{p[0]} has no default and the pinned interface does not pass it"
    return None


def test_installed_vllm_is_a_pinned_release() -> None:
    assert INSTALLED in PINNED, f"vLLM {vllm.__version__} has no pinned interface"
    assert RELEASE.tested == INSTALLED, f"compat serves it as {RELEASE.tested}"
    assert sorted(PINNED) == sorted(r.tested for r in RELEASES.values())


# Collected for the installed release (for 0.33.0's shape when it has no pin: the test
# above fails then).
_INSTALLED_PIN = INSTALLED if INSTALLED in PINNED else "0.33.0"


@pytest.mark.parametrize("name", _methods(_INSTALLED_PIN))
def test_method_matches_vllm_and_pagedkv(name: str) -> None:
    pinned = _pinned(_INSTALLED_PIN, name)
    theirs = _shape(inspect.getattr_static(VllmKVCacheManager, name))
    ours = _shape(inspect.getattr_static(KVCacheManager, name))
    assert theirs == pinned, f"vLLM's {name} drifted from the pinned protocol"
    assert _incompatible(ours, pinned) is None, f"pagedkv.vllm.KVCacheManager.{name}"


@pytest.mark.parametrize("version", sorted(PINNED))
def test_pagedkv_serves_every_pinned_release(version: str) -> None:
    """One manager for every release: each pinned method is callable as that release calls it."""
    for name in _methods(version):
        ours = _shape(inspect.getattr_static(KVCacheManager, name))
        assert _incompatible(ours, _pinned(version, name)) is None, (version, name)


def test_every_public_vllm_method_is_pinned_or_listed() -> None:
    """A method vLLM adds to its manager is either pinned here or known to be unused."""
    unused_by_the_scheduler: set[str] = set()
    public = {
        n
        for n, v in vars(VllmKVCacheManager).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }
    pinned = set(_methods(_INSTALLED_PIN))
    assert public - pinned - unused_by_the_scheduler == set()
    assert pinned - {"__init__"} - public == set(), "pinned methods this vLLM lacks"


@pytest.mark.parametrize("other", sorted(set(PINNED) - {_INSTALLED_PIN}))
def test_another_releases_pin_is_drift_here(other: str) -> None:
    """The comparison catches real drift: the installed vLLM's manager differs from every
    other release's pin in some method, or in the set of methods."""
    public = {
        n
        for n, v in vars(VllmKVCacheManager).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))
    }
    methods = _methods(other)
    differs = [
        name
        for name in methods
        if not hasattr(VllmKVCacheManager, name)
        or _shape(inspect.getattr_static(VllmKVCacheManager, name)) != _pinned(other, name)
    ]
    assert differs or public != set(methods) - {"__init__"}


def test_a_changed_parameter_is_caught() -> None:
    def pinned(self: Any, request: Any, max_cache_hit_length: int | None = None) -> None: ...
    def renamed(self: Any, request: Any, max_hit: int | None = None) -> None: ...
    def other_default(self: Any, request: Any, max_cache_hit_length: int | None = 0) -> None: ...
    def required_extra(self: Any, request: Any, bound: int) -> None: ...
    def extra_default(self: Any, request: Any, max_cache_hit_length: int | None = None,
                      extra: int = 0) -> None: ...  # fmt: skip

    assert _incompatible(_shape(pinned), _shape(pinned)) is None
    assert _incompatible(_shape(extra_default), _shape(pinned)) is None
    for drifted in (renamed, other_default, required_extra):
        assert _shape(drifted) != _shape(pinned)
        assert _incompatible(_shape(drifted), _shape(pinned)) is not None, drifted.__name__


def test_the_033_pin_is_the_base_of_the_others() -> None:
    assert PINNED["0.33.0"] is SchedulerKVCacheManager
    assert "get_num_cached_tokens" in _methods("0.34.0")
    assert "get_num_common_prefix_blocks" not in _methods("0.34.0")
    assert "max_cache_hit_length" not in [p[0] for p in _pinned("0.32.0", "get_computed_blocks")]


@pytest.mark.parametrize("cls", [VllmKVCacheManager, KVCacheManager])
def test_attributes_exist(cls: type[Any]) -> None:
    manager = make_manager(cls, 64)
    for name in ATTRIBUTES:
        assert hasattr(manager, name), name
