"""`simulate --reference` where the reference models are missing (an installed wheel, no
checkout): one line saying how to get them, exit status 2, no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv.sim import factory


def test_reference_without_the_support_package_says_how_to_get_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pagedkv_reference", None)  # import fails as if absent
    # as installed: no checkout (and so no testing/ folder) around the package
    monkeypatch.setattr(factory, "__file__", str(tmp_path / "lib" / "pagedkv" / "sim" / "f.py"))
    argv = ["simulate", "--reference", "--workload", "chat", "--requests", "5", "--no-progress"]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        "error: --reference needs the pure-Python reference model, which the wheel does not "
        "install: add the testing/ folder of a pagedkv source checkout to PYTHONPATH"
    ]
