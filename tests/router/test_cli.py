"""`python -m pagedkv router --connect ...`: two engines followed at once, their blocks and
the ranked engines of the requests given printed; a bad endpoint or lookup file is an
error message and status 2, a silence a line and status 1."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from router_streams import B, manager, publisher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_follows_two_engines_and_ranks_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ma, mb = manager(), manager()
    ma.allocate(1, list(range(4 * B)))
    mb.allocate(1, list(range(2 * B)))
    pa, pb = publisher(ma), publisher(mb)
    assert pa.replay_endpoint is not None and pb.replay_endpoint is not None
    lookups = tmp_path / "requests.jsonl"
    lookups.write_text(
        json.dumps({"token_ids": list(range(4 * B))})
        + "\n"
        + json.dumps({"token_ids": list(range(500, 500 + B))})
        + "\n"
    )
    args = ["router", "--connect", pa.endpoint, "--replay", pa.replay_endpoint]
    args += ["--connect", pb.endpoint, "--replay", pb.replay_endpoint]
    args += ["--engine", "a", "--engine", "b", "--block-size", str(B)]
    args += ["--lookup", str(lookups), "--count", "2", "--interval", "1.0"]
    try:
        assert main(args) == 0
    finally:
        pa.close()
        pb.close()
    out = capsys.readouterr().out.splitlines()
    last = out[-5:]  # the second report: its header, two engines, two lookups
    assert last[0].startswith("-- ") and last[0].endswith(" 6 blocks held"), out
    assert last[1].startswith("a  GPU=4  batches=") and "snapshots=1" in last[1]
    assert last[2].startswith("b  GPU=2  batches=")
    assert last[3] == "lookup 0: a 4, b 2"
    assert last[4] == "lookup 1: no engine holds any"


@pytest.mark.parametrize("endpoint", ["bogus://x", "tcp://127.0.0.1:notaport"])
def test_a_bad_endpoint_is_an_error_message(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["router", "--connect", endpoint, "--duration", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot connect to {endpoint}: "), err


def test_a_bad_lookup_file_is_an_error_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1], "block_hashes": [2]}\n')
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    assert main(["router", "--connect", endpoint, "--lookup", str(bad)]) == 2
    assert "bad.jsonl:1: give token_ids or block_hashes" in capsys.readouterr().err


def test_nobody_publishing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    assert main(["router", "--connect", endpoint, "--duration", "0.3"]) == 1
    captured = capsys.readouterr()
    assert "nothing received in 0." in captured.err
    assert captured.out.splitlines()[-1] == f"{endpoint}  no blocks  batches=0 gaps=0 " + (
        "replays=0 snapshots=0 lost=0 restarts=0"
    )
