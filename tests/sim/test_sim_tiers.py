"""`python -m pagedkv simulate` with tiers below the GPU (`--host-tier-bytes`, `--compress`,
`--remote`): both runs, the JSON keys, the real bytes (`--check` reads every hit back from
the data pool), a real Redis server on loopback for `--remote` (killed, too), and the
errors. `sim.tier_run` says what the tiered run does.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lz4")

from pagedkv.__main__ import main
from pagedkv.sim.requests import Request
from pagedkv.sim.scheduler import _Seq
from pagedkv.sim.tier_run import TierCheckError, TierDriver, parse_bytes
from pagedkv.tiers.cache import TieredCache
from redis_fixtures import (
    ServerProcess,
    running_cluster,
    running_server,
    server_binary,
)

pytestmark = pytest.mark.slow  # tier runs with real KV and real servers: about a minute

# A small mixed workload on a cache that evicts a lot: 256 blocks of 16 tokens.
SMALL = ["simulate", "--no-progress", "--requests", "60", "--doc-tokens", "2048"]
EVICTING = [*SMALL, "--num-blocks", "256"]
TIER_KEYS = ("tier_hit_tokens", "compression_ratio", "bytes_demoted", "bytes_promoted")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_a_host_tier_raises_the_hit_rate_with_every_hit_checked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "t.json"
    rc, out, err = _run(
        capsys, *EVICTING, "--host-tier-bytes", "2GiB", "--check", "--json", str(js)
    )
    assert rc == 0, err
    for needle in ("no tiers", "from CPU", "blocks demoted", "compression ratio", "check "):
        assert needle in out, out
    doc = _json(js)
    for key in TIER_KEYS:
        assert key in doc, key
    base, tiered = doc["runs"]
    assert doc["tier_hit_tokens"]["CPU"] > 0
    assert doc["hit_rate_with_tiers"] > doc["hit_rate_without_tiers"]
    assert tiered["prefix_hit_tokens"] == tiered["gpu_hit_tokens"] + doc["tier_hit_tokens"]["CPU"]
    assert tiered["blocks_demoted"] > 0 and tiered["blocks_promoted"] > 0
    # 2 GiB of llama-3-8b KV (2 MiB per block of 16): the host tier holds 1024 blocks.
    assert doc["bytes_demoted"] == tiered["blocks_demoted"] * 2 * (1 << 20)
    assert doc["bytes_promoted"] == tiered["blocks_promoted"] * 2 * (1 << 20)
    assert tiered["checked_tokens"] > tiered["prefix_hit_tokens"]
    assert tiered["tiers"][0]["corrupt"] == 0
    assert base["prefix_hit_tokens"] < tiered["prefix_hit_tokens"]


def test_a_compressed_tier_reports_its_ratio(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    js = tmp_path / "c.json"
    argv = [*EVICTING, "--host-tier-bytes", "1GiB", "--compress", "shuffle+lz4", "--check"]
    rc, _, err = _run(capsys, *argv, "--json", str(js))
    assert rc == 0, err
    doc = _json(js)
    assert set(doc["tier_hit_tokens"]) == {"CPU_COMPRESSED"}
    assert doc["tier_hit_tokens"]["CPU_COMPRESSED"] > 0
    # bf16 layer-0 KV: the byte shuffle makes the exponent bytes compressible.
    assert doc["compression_ratio"] > 1.05, doc["compression_ratio"]


def test_the_check_catches_a_load_that_writes_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teeth: a tier that claims its hits but leaves the GPU blocks as they were."""

    def lying_load(self: TieredCache, alloc: Any) -> int:
        return int(alloc.hit_tokens)

    monkeypatch.setattr(TieredCache, "load", lying_load)
    with pytest.raises(TierCheckError, match="not the one its tokens give"):
        main([*EVICTING, "--host-tier-bytes", "2GiB", "--check"])


def test_the_check_catches_lost_copy_on_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: forks (parallel sampling, beams) whose copy-on-write copies are skipped."""
    monkeypatch.setattr(TierDriver, "copy", lambda self, pairs: None)
    with pytest.raises(TierCheckError):
        main([*SMALL, "--workload", "sampling", "--host-tier-bytes", "2GiB", "--check"])


def test_the_check_catches_lost_swaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: swapped-out sequences whose KV is not moved to the CPU swap pool and back."""
    monkeypatch.setattr(TierDriver, "swapped", lambda self, pairs, *, out: None)
    with pytest.raises(TierCheckError):
        main([*EVICTING, "--host-tier-bytes", "2GiB", "--check"])


@pytest.fixture(params=["redis"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server(server_binary(request.param), tmp_path / "server") as s:
        yield s


def test_a_remote_tier_on_a_real_server(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    js = tmp_path / "r.json"
    argv = [*EVICTING, "--remote", server.url, "--compress", "lz4", "--check"]
    rc, _, err = _run(capsys, *argv, "--json", str(js))
    assert rc == 0, err
    doc = _json(js)
    assert set(doc["tier_hit_tokens"]) == {"REMOTE"}
    assert doc["tier_hit_tokens"]["REMOTE"] > 0
    assert doc["hit_rate_with_tiers"] > doc["hit_rate_without_tiers"]
    assert server.client().dbsize() > 0, "the blocks are on the server"


def test_host_and_remote_tiers_stack(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    js = tmp_path / "hr.json"
    argv = [*EVICTING, "--host-tier-bytes", "256MiB", "--remote", server.url, "--check"]
    rc, _, err = _run(capsys, *argv, "--json", str(js))
    assert rc == 0, err
    doc = _json(js)
    assert list(doc["tier_hit_tokens"]) == ["CPU", "REMOTE"]
    assert doc["tier_hit_tokens"]["CPU"] > 0 and doc["tier_hit_tokens"]["REMOTE"] > 0


def test_a_remote_tier_on_a_real_cluster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Three Redis nodes on loopback: the blocks spread over the nodes' slots."""
    with running_cluster(server_binary("redis"), tmp_path / "cluster") as cluster:
        js = tmp_path / "c.json"
        argv = [*EVICTING, "--remote", cluster.url, "--remote-cluster", "--check"]
        rc, _, err = _run(capsys, *argv, "--json", str(js))
        assert rc == 0, err
        doc = _json(js)
        assert doc["tier_hit_tokens"]["REMOTE"] > 0
        assert doc["runs"][1]["tiers"][0]["errors"] == 0
        sizes = [node.client().dbsize() for node in cluster.nodes]
        assert sum(1 for n in sizes if n > 0) == 3, sizes


def test_a_dead_server_makes_misses_not_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, server: ServerProcess
) -> None:
    url = server.url
    server.kill()
    js = tmp_path / "d.json"
    t0 = time.monotonic()
    rc, _, err = _run(capsys, *EVICTING, "--remote", url, "--json", str(js))
    assert rc == 0, err
    assert time.monotonic() - t0 < 120
    doc = _json(js)
    assert doc["tier_hit_tokens"]["REMOTE"] == 0
    assert doc["runs"][1]["tiers"][0]["dropped_puts"] > 0
    assert doc["hit_rate_with_tiers"] == pytest.approx(doc["hit_rate_without_tiers"], abs=0.05)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--compress", "lz4"], "--compress needs"),
        (["--remote-cluster"], "--remote-cluster needs --remote"),
        (["--host-tier-bytes", "1GiB", "--mrc"], "not both"),
        (["--host-tier-bytes", "1GiB", "--num-blocks", "128,256"], "one configuration"),
        (["--host-tier-bytes", "1GiB", "--model", "gemma-3-12b"], "KV-cache groups"),
    ],
)
def test_errors(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    rc, _, err = _run(capsys, *SMALL, *extra)
    assert rc == 2
    assert message in err, err


def test_bad_byte_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("", "abc", "0", "-5G", "1X"):
        with pytest.raises(SystemExit):
            main([*SMALL, "--host-tier-bytes", bad])
    assert "host-tier-bytes" in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("1073741824") == 1 << 30
    # sim.units' syntax (tests/sim/test_units.py has the whole table)
    assert parse_bytes("64GiB") == parse_bytes("64gib") == 64 << 30
    assert parse_bytes("64GB") == 64 * 10**9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5TiB") == 3 << 39
    assert parse_bytes("4KiB") == 4096
    for bad in ("", "G", "0", "-1", "0.5", "1X", "nan", "inf", "1e30", "64G", "4k"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_token_range_is_a_slice_of_all_tokens() -> None:
    rng = random.Random(0)
    prompt = np.arange(100, 137, dtype=np.uint32)
    req = Request(0, len(prompt), 64, prompt_tokens=prompt)
    for _ in range(200):
        gen = rng.randrange(0, 60)
        cuts = sorted(rng.sample(range(37, 37 + 60), 2))
        segs = ((0, 37), (1, cuts[0]), (2, cuts[1]))
        s = _Seq(0, req, generated=gen, segments=segs)
        full = s.all_tokens()
        a = rng.randrange(0, len(full) + 1)
        b = rng.randrange(a, len(full) + 1)
        np.testing.assert_array_equal(s.token_range(a, b), full[a:b])
