"""`pagedkv.vllm_plugin`: the `vllm.general_plugins` entry point behind
`PAGEDKV_VLLM_SCHEDULER=1`, against the installed vLLM's own `SchedulerConfig` (the engine
room shows it inside a running engine: tests/engine)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config.scheduler import SchedulerConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

import pagedkv.vllm
from pagedkv import vllm_plugin


@pytest.fixture
def restore() -> Iterator[None]:
    original = SchedulerConfig.get_scheduler_cls
    yield
    SchedulerConfig.get_scheduler_cls = original  # type: ignore[method-assign]


def config(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(max_model_len=2048, is_encoder_decoder=False, **kw)


def test_the_entry_point_is_declared():
    """In pyproject.toml; and where pagedkv is installed (CI), in its metadata too."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {"pagedkv_scheduler": "pagedkv.vllm_plugin:register"}
    try:
        installed = distribution("pagedkv").entry_points
    except PackageNotFoundError:
        return  # run from the source tree (PYTHONPATH): no metadata to read
    found = {ep.name: ep.value for ep in installed if ep.group == "vllm.general_plugins"}
    assert found == declared


@pytest.mark.parametrize("value", [None, "", "0", "false", "off", "No"])
def test_off_changes_nothing(monkeypatch, restore, value):
    if value is None:
        monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV, value)
    before = SchedulerConfig.get_scheduler_cls
    vllm_plugin.register()
    assert SchedulerConfig.get_scheduler_cls is before
    assert config().get_scheduler_cls() is VllmScheduler
    assert config(async_scheduling=True).get_scheduler_cls() is VllmAsyncScheduler


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_on_picks_pagedkvs_scheduler_sync_and_async(monkeypatch, restore, value):
    monkeypatch.setenv(vllm_plugin.ENV, value)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once: wrapped once
    assert config().get_scheduler_cls() is pagedkv.vllm.Scheduler
    assert config(async_scheduling=True).get_scheduler_cls() is pagedkv.vllm.AsyncScheduler
    named = config(scheduler_cls="pagedkv.vllm.AsyncScheduler")
    assert named.get_scheduler_cls() is pagedkv.vllm.AsyncScheduler


def test_on_with_another_scheduler_class_raises(monkeypatch, restore):
    monkeypatch.setenv(vllm_plugin.ENV, "1")
    vllm_plugin.register()
    other = config(scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")
    with pytest.raises(ValueError, match="PAGEDKV_VLLM_SCHEDULER is on but a scheduler class"):
        other.get_scheduler_cls()


def test_a_bad_value_raises_and_changes_nothing(monkeypatch, restore):
    monkeypatch.setenv(vllm_plugin.ENV, "maybe")
    before = SchedulerConfig.get_scheduler_cls
    with pytest.raises(ValueError, match="PAGEDKV_VLLM_SCHEDULER='maybe'"):
        vllm_plugin.register()
    assert SchedulerConfig.get_scheduler_cls is before
