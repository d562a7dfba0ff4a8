"""`pagedkv events --connect` tells a user what went wrong: a bad endpoint is an error
message and status 2 (no traceback), and a stream that delivers nothing ends with a line
saying so and status 1 (it used to exit 0 silently)."""

from __future__ import annotations

import socket

import pytest

from pagedkv.__main__ import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("endpoint", ["bogus://x", "tcp://", "tcp://127.0.0.1:notaport"])
def test_a_bad_endpoint_is_an_error_message(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "--connect", endpoint, "--duration", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot connect to {endpoint}: "), err
    assert "Traceback" not in err


def test_nobody_publishing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    assert main(["events", "--connect", endpoint, "--duration", "0.3"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"following {endpoint}" in captured.err
    assert f"nothing received from {endpoint} in 0." in captured.err
