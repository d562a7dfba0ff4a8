"""`sim.units`: one size syntax for every byte option, and counts with k/M/G or Ki/Mi/Gi.

Binary units are 1024^n, SI units 1000^n, a bare K/M/G/T/P is refused as ambiguous with a
message that names both spellings; plain integers are bytes (or a count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv.sim.tier_run import parse_bytes as tier_parse_bytes
from pagedkv.sim.units import parse_bytes, parse_count

SMALL = ["simulate", "--requests", "20", "--doc-tokens", "2048", "--no-progress"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("131072", 131072),
        ("128KiB", 128 * 1024),
        ("128kib", 128 * 1024),
        ("128 KiB", 128 * 1024),
        ("64GiB", 64 << 30),
        ("64Gi", 64 << 30),
        ("1.5TiB", 3 << 39),
        ("2PiB", 2 << 50),
        ("512GB", 512 * 10**9),
        ("512gb", 512 * 10**9),
        ("512MB", 512 * 10**6),
        ("1kB", 1000),
        ("1KB", 1000),
        ("3TB", 3 * 10**12),
        ("100B", 100),
        ("1_048_576", 1 << 20),
    ],
)
def test_byte_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value
    assert tier_parse_bytes(text) == value  # --host-tier-bytes' parser is this one


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("512G", "'512G' is ambiguous: write 512GiB for 512 x 1024^3 bytes or 512GB for"),
        ("512K", "write 512KiB for 512 x 1024^1 bytes or 512kB for 512 x 1000^1 bytes"),
        ("512M", "write 512MiB"),
        ("1.5T", "write 1.5TiB"),
        ("2p", "write 2PiB"),
        ("0.3KiB", "not a whole number of bytes"),
        ("abc", "bad byte size 'abc': give a whole number of bytes, or a number with a unit"),
        ("64XB", "unknown unit 'xb'"),
        ("", "bad byte size ''"),
        ("0", "must be in [1, 2**63)"),
        ("-1KiB", "must be in [1, 2**63)"),
        ("8EiB", "unknown unit"),
        ("nan", "bad byte size"),
        ("1e9", "bad byte size '1e9'"),
    ],
)
def test_byte_size_refusals(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_bytes(text)
    assert message in str(exc.value)


def test_every_refusal_names_the_forms() -> None:
    with pytest.raises(ValueError) as exc:
        parse_bytes("12 apples")
    for form in ("KiB", "GiB", "kB", "GB", "1024^n", "1000^n"):
        assert form in str(exc.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("64k", 64000),
        ("64K", 64000),
        ("64Ki", 65536),
        ("2M", 2 * 10**6),
        ("1Mi", 1 << 20),
        ("1G", 10**9),
        ("1.5k", 1500),
        ("-1", -1),  # the option refuses it with its own bound
        ("65_536", 65536),
    ],
)
def test_counts(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("64x", "unknown suffix 'x'"),
        ("64kb", "unknown suffix 'kb'"),
        ("1.0001k", "not a whole number"),
        ("many", "bad number 'many'"),
    ],
)
def test_count_refusals(text: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_count(text)
    assert message in str(exc.value)
    assert "64k = 64000" in str(exc.value) and "64Ki = 65536" in str(exc.value)


def test_kv_bytes_per_token_takes_units(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "f.json"
    assert main([*SMALL, "--kv-bytes-per-token", "128KiB", "--json", str(js)]) == 0
    assert "131072 bytes of KV per token" in capsys.readouterr().out
    assert json.loads(js.read_text())["kv_bytes_per_token"] == 131072


@pytest.mark.parametrize("option", ["--kv-bytes-per-token", "--host-tier-bytes"])
def test_ambiguous_byte_options_are_refused(
    capsys: pytest.CaptureFixture[str], option: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL, option, "512G"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: byte size '512G' is ambiguous" in err
    assert "512GiB" in err and "512GB" in err


def test_counts_on_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    js = tmp_path / "f.json"
    assert main([*SMALL, "--num-blocks", "1Ki,2k", "--json", str(js)]) == 0
    capsys.readouterr()
    assert [r["num_blocks"] for r in json.loads(js.read_text())["runs"]] == [1024, 2000]
    with pytest.raises(SystemExit):
        main([*SMALL, "--num-blocks", "64x"])
    err = capsys.readouterr().err
    assert "argument --num-blocks: bad number '64x': unknown suffix 'x'" in err
    assert "64Ki = 65536" in err
