"""pytest plugin: build vLLM's schedulers with another KV-cache manager class.

Load with `-p vllm_suite.swap_manager`. When PAGEDKV_VLLM_MANAGER is `module:Class`, the
name `KVCacheManager` in `vllm.v1.core.sched.scheduler` is rebound to that class before any
test runs. `Scheduler.__init__` is vLLM 0.33.0's only construction site of the manager, and it
reads that module-level name; every other import of `KVCacheManager` in vLLM is for typing
only, and the scheduler tests construct none themselves, so the rebinding reaches every
scheduler the tests build (AsyncScheduler and the others inherit that `__init__`). The class
receives the keywords vLLM's manager does. Unset: vLLM's own manager, untouched. vLLM 0.34.0
builds its manager the same way.

When PAGEDKV_VLLM_SUITE_VERSION is set (`vllm_suite.run` sets it), the installed vLLM must be
that release: the tests fetched for one release are never run against another.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

ENV_VAR = "PAGEDKV_VLLM_MANAGER"
VERSION_ENV_VAR = "PAGEDKV_VLLM_SUITE_VERSION"
_SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
_NAME = "KVCacheManager"  # the name Scheduler.__init__ calls
# The class swapped in, or None for vLLM's own.
_swapped = pytest.StashKey[type | None]()


def load_class(spec: str) -> type:
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise pytest.UsageError(f"{ENV_VAR}={spec!r}: expected 'module:Class'")
    target: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    if not isinstance(target, type):
        raise pytest.UsageError(f"{ENV_VAR}={spec!r} names {target!r}, not a class")
    return target


def _swap(spec: str) -> type:
    cls = load_class(spec)
    scheduler = importlib.import_module(_SCHEDULER_MODULE)
    if not hasattr(scheduler, _NAME):
        raise pytest.UsageError(f"{_SCHEDULER_MODULE} no longer binds {_NAME}")
    setattr(scheduler, _NAME, cls)
    return cls


def check_installed_version(expected: str) -> None:
    import vllm

    installed = str(vllm.__version__).split("+", 1)[0]  # "+cpu" and the like: same release
    if installed != expected:
        raise pytest.UsageError(
            f"{VERSION_ENV_VAR}={expected} but vLLM {vllm.__version__} is installed: "
            f"these are vLLM {expected}'s tests"
        )


def pytest_configure(config: pytest.Config) -> None:
    expected = os.environ.get(VERSION_ENV_VAR)
    if expected:
        check_installed_version(expected)
    spec = os.environ.get(ENV_VAR)
    config.stash[_swapped] = _swap(spec) if spec else None


def pytest_report_header(config: pytest.Config) -> str:
    cls = config.stash.get(_swapped, None)
    if cls is None:
        return "KV-cache manager: vLLM's own"
    # Where it was imported from: the checkout or wheel the run really tested.
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return f"KV-cache manager: {cls.__module__}.{cls.__qualname__} ({path})"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test whose scheduler would not get the swapped class (a rebinding undone)."""
    cls = item.config.stash.get(_swapped, None)
    if cls is not None:
        scheduler = importlib.import_module(_SCHEDULER_MODULE)
        if getattr(scheduler, _NAME) is not cls:
            raise RuntimeError(f"{_SCHEDULER_MODULE}.{_NAME} is no longer {cls!r}")
