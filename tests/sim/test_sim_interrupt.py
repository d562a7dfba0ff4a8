"""Ctrl-C on a plain `simulate` run (not the sizing runs, which save what they know): the
command stops without a traceback and with the status a shell gives SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pagedkv.__main__ import main
from sigint import sigint_default_in_children


def test_sigint_stops_a_plain_run_without_a_traceback() -> None:
    # A long built-in run (minutes), interrupted once it is well under way.
    argv = ["simulate", "--requests", "100000", "--no-progress"]
    with sigint_default_in_children():  # CI may have started pytest ignoring SIGINT
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
    try:
        time.sleep(3.0)  # imports done, the replay running
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().endswith("interrupted")


def test_keyboard_interrupt_in_process_returns_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pagedkv.__main__ as entry

    def stop(*_: object, **__: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "simulate", stop)
    assert main(["simulate", "--requests", "5"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"
