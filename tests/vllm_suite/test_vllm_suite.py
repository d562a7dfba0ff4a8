"""testing/vllm_suite, the harness that runs vLLM's scheduler tests, checked without vLLM:
the JUnit counts, the sdist extraction and its pin, the fake Hugging Face cache's layout,
and the plugin's reading of PAGEDKV_VLLM_MANAGER. The vLLM run itself is CI's last step."""

from __future__ import annotations

import io
import sys
import tarfile
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_suite import fetch, hf_cache, pins
from vllm_suite.results import read_junit
from vllm_suite.run import MIN_PASSED_BY_VERSION
from vllm_suite.swap_manager import check_installed_version, load_class

RELEASE = pins.pin("0.34.0")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.v1.core.test_scheduler" name="test_ok[True]" />
<testcase classname="tests.v1.core.test_scheduler" name="test_bad">
  <failure message="AssertionError: 3 == 4&#10;more detail">long text</failure></testcase>
<testcase classname="tests.v1.core.test_scheduler.TestGroup" name="test_setup">
  <error message="">&#10;fixture 'x' not found&#10;second line</error></testcase>
<testcase classname="tests.v1.core.test_scheduler" name="test_skip">
  <skipped message="no GPU" /></testcase>
</testsuite></testsuites>
"""


def test_junit_counts_and_first_error_lines(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    outcomes = read_junit(path)
    assert outcomes.counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    assert outcomes.problems == {
        "tests/v1/core/test_scheduler.py::test_bad": "AssertionError: 3 == 4",
        "tests/v1/core/test_scheduler.py::TestGroup::test_setup": "fixture 'x' not found",
    }


def _sdist(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name in names:
            data = b"# test file\n"
            info = tarfile.TarInfo(f"vllm-{RELEASE.version}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_extracts_only_tests_and_pytest_config(tmp_path: Path) -> None:
    sdist = tmp_path / "vllm.tar.gz"
    _sdist(sdist, [pins.SCHEDULER_TESTS, "tests/conftest.py", "pyproject.toml", "vllm/x.py"])
    tree = tmp_path / "tree"
    fetch.extract_tests(RELEASE, sdist, tree)
    found = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    # vLLM's package source must not shadow the installed vLLM.
    assert found == ["pyproject.toml", "tests/conftest.py", pins.SCHEDULER_TESTS]


def test_an_sdist_without_the_scheduler_tests_is_refused(tmp_path: Path) -> None:
    sdist = tmp_path / "vllm.tar.gz"
    _sdist(sdist, ["tests/conftest.py"])
    with pytest.raises(SystemExit, match="holds no"):
        fetch.extract_tests(RELEASE, sdist, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_an_sdist_with_another_digest_is_refused(tmp_path: Path) -> None:
    sdist = tmp_path / "vllm.tar.gz"
    _sdist(sdist, [pins.SCHEDULER_TESTS])
    with pytest.raises(SystemExit, match="expected " + RELEASE.sdist_sha256):
        fetch.obtain_sdist(RELEASE, sdist, pins.SIMPLE_INDEX_URL)


def test_each_release_has_its_pin_folders_and_gate() -> None:
    assert set(MIN_PASSED_BY_VERSION) == set(pins.SDIST_SHA256)
    assert pins.DEFAULT_VERSION in pins.SDIST_SHA256
    folders = {pins.pin(v).work_dir for v in pins.SDIST_SHA256}
    assert len(folders) == len(pins.SDIST_SHA256)
    for version in pins.SDIST_SHA256:
        assert pins.pin(version).sdist_name == f"vllm-{version}.tar.gz"


def test_a_release_without_a_pin_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"vLLM 0\.35\.0 has no pin .*0\.33\.0, 0\.34\.0"):
        pins.pin("0.35.0")


def test_plugin_refuses_tests_of_another_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.33.0+cpu"))
    check_installed_version("0.33.0")  # the same release, a local build tag
    with pytest.raises(pytest.UsageError, match=r"vLLM 0\.33\.0\+cpu is installed"):
        check_installed_version("0.34.0")


def test_fake_cache_resolves_each_model_offline(tmp_path: Path) -> None:
    hub_lib = pytest.importorskip("huggingface_hub")  # installed with transformers
    hf_cache.write(tmp_path)
    for repo_id in (
        "facebook/opt-125m",
        "llava-hf/llava-1.5-7b-hf",
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "Qwen/Qwen3-0.6B",
    ):
        found = hub_lib.try_to_load_from_cache(repo_id, "config.json", cache_dir=tmp_path / "hub")
        assert isinstance(found, str), repo_id
        assert (
            Path(found).read_bytes()
            == (pins.HF_CONFIGS / repo_id.replace("/", "--") / "config.json").read_bytes()
        )


def test_manager_spec_is_module_colon_class() -> None:
    assert load_class("collections:OrderedDict") is OrderedDict
    for bad in ("collections.OrderedDict", ":OrderedDict", "collections:"):
        with pytest.raises(pytest.UsageError, match="expected 'module:Class'"):
            load_class(bad)
    with pytest.raises(pytest.UsageError, match="not a class"):
        load_class("os.path:join")
