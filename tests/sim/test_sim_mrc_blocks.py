"""The pure cache replay of a trace's hash ids at block granularity (`sim.mrc_blocks`: Rust's
`block_replay` and `policy_replay`): its curve and its FIFO against plain replays written
here, the optimum above both and right on a hand-checked trace, the warm-up window, and
`simulate --mrc-only` saying which replay its curve is (`--mrc-replay`)."""

from __future__ import annotations

import json
import random
from collections import OrderedDict, deque
from pathlib import Path

import pytest

from pagedkv.__main__ import main
from pagedkv._core import BlockReplay
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.mrc_blocks import block_curve, block_replay, first_counted
from pagedkv.sim.requests import Workload
from pagedkv.sim.trace import read_trace

ID_TOKENS = 512  # Mooncake's tokens per id


def _trace(path: Path, prompts: list[tuple[list[int], int]]) -> Workload:
    """A Mooncake-format trace of `(hash_ids, input_length)` prompts, read back."""
    with path.open("w") as f:
        for i, (ids, n) in enumerate(prompts):
            f.write(
                json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
                + "\n"
            )
    return read_trace(path, limit=None, ms_per_step=20.0, trace_format="mooncake")


def _random_prompts(seed: int, count: int) -> list[tuple[list[int], int]]:
    """Paths in a small tree of ids (3 children a node, 1 to 4 deep), lengths anywhere within
    their last id (a partial last id included)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        node, ids = 0, []
        for _ in range(rnd.randint(1, 4)):
            node = node * 3 + rnd.randint(1, 3)
            ids.append(node)
        out.append((ids, rnd.randint((len(ids) - 1) * ID_TOKENS + 1, len(ids) * ID_TOKENS)))
    return out


def _blocks(ids: list[int], n: int, bs: int) -> list[tuple[int, ...]]:
    """The prompt's full blocks, each named by the ids it and its prefix cover (and which part
    of its id it is): equal names exactly where the contents are equal."""
    out = []
    for k in range(n // bs):
        if bs <= ID_TOKENS:
            per = ID_TOKENS // bs
            out.append((*ids[: k // per + 1], k % per))
        else:
            out.append(tuple(ids[: (k + 1) * (bs // ID_TOKENS)]))
    return out


def _plain(
    prompts: list[tuple[list[int], int]], bs: int, size: int, policy: str, first: int
) -> int:
    """Hit blocks of a plain replay: each prompt's capped lookup (the longest cached run from
    the first block), then its full blocks touched tail first; LRU moves a touched block to
    the newest end, FIFO leaves a cached one where it is."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    order: deque[tuple[int, ...]] = deque()
    hits = 0
    for r, (ids, n) in enumerate(prompts):
        blocks = _blocks(ids, n, bs)
        run = 0
        for b in blocks[: (n - 1) // bs]:
            if b not in cache:
                break
            run += 1
        hits += run if r >= first else 0
        for b in reversed(blocks):
            if b in cache:
                if policy == "lru":
                    cache.move_to_end(b)
                continue
            if len(cache) == size:
                victim = order.popleft() if policy == "fifo" else next(iter(cache))
                del cache[victim]
            cache[b] = None
            if policy == "fifo":
                order.append(b)
    return hits


@pytest.mark.parametrize("bs", [128, 512, 1024])
@pytest.mark.parametrize("warmup", [0.0, 0.5])
def test_curve_and_fifo_equal_plain_replays(tmp_path: Path, bs: int, warmup: float) -> None:
    prompts = _random_prompts(bs, 60)
    w = _trace(tmp_path / "t.jsonl", prompts)
    first = first_counted(w, warmup)
    rep = block_replay(w, bs)
    curve = block_curve(w, bs, warmup=warmup, replay=rep)
    assert curve.replay == "cache" and "pure cache replay" in curve.method()
    assert curve.prompt_tokens == sum(n for _, n in prompts[first:])
    distinct = len({b for ids, n in prompts for b in _blocks(ids, n, bs)})
    sizes = list(range(1, distinct + 2))
    fifo = rep.hits(sizes, "fifo", first)
    lru = rep.hits(sizes, "lru", first)
    opt = rep.hits(sizes, "optimal", first)
    for i, size in enumerate(sizes):
        want = _plain(prompts, bs, size, "lru", first)
        assert round(curve.hit_rate(size) * curve.prompt_tokens / bs) == want == lru[i], size
        assert fifo[i] == _plain(prompts, bs, size, "fifo", first), size
        assert opt[i] >= max(lru[i], fifo[i]), size
    # Room for every block: nothing is evicted, and every policy hits what can be hit.
    assert opt[-1] == lru[-1] == fifo[-1] > 0


def test_the_optimum_on_a_hand_checked_trace(tmp_path: Path) -> None:
    # Prompts a b a b a of one full block each (a partial second id: the block is looked up).
    a, b = [1, 100], [2, 101]
    w = _trace(tmp_path / "t.jsonl", [(ids, 600) for ids in (a, b, a, b, a)])
    rep = block_replay(w, 512)
    # One block of room: LRU and FIFO always hold the other prompt's block; the optimum keeps
    # a's throughout (b's next use is never before a's) and hits it twice.
    assert rep.hits([1], "lru", 0) == rep.hits([1], "fifo", 0) == [0]
    assert rep.hits([1], "optimal", 0) == [2]
    assert rep.hits([2], "optimal", 0) == [3]  # both fit: every repeat hits
    assert rep.hits([1], "optimal", 3) == [1]  # counting the last two prompts only


def test_bad_input_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="request 0: 1025 prompt tokens but 2 ids"):
        BlockReplay([1, 2], [0, 2], [1025], [0], 512, 512)
    with pytest.raises(InvalidArgumentError, match="one must divide the other"):
        BlockReplay([1], [0, 1], [512], [0], 512, 24)
    with pytest.raises(InvalidArgumentError, match="offsets"):
        BlockReplay([1], [0, 5], [512], [0], 512, 512)
    rep = BlockReplay([1], [0, 1], [512], [0], 512, 512)
    with pytest.raises(InvalidArgumentError, match="policy must be lru, fifo or optimal"):
        rep.hits([1], "arc", 0)
    w = _trace(tmp_path / "t.jsonl", [([1], 512)])
    with pytest.raises(ValueError, match="warmup must be in"):
        block_curve(w, 512, warmup=1.0)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_mrc_only_on_a_trace_says_it_is_a_pure_cache_replay(
    capsys: pytest.CaptureFixture[str], mooncake_trace: Path, tmp_path: Path
) -> None:
    base = ["simulate", "--trace", str(mooncake_trace), "--limit", "300", "--block-size", "512"]
    doc_path = tmp_path / "cache.json"
    rc, out, _ = _cli(capsys, *base, "--mrc-only", "--no-progress", "--json", str(doc_path))
    assert rc == 0, out
    assert "pure cache replay" in out and "optimal bound, block size 512" in out
    assert "the curve's estimate, not checked by full runs" in out
    doc = json.loads(doc_path.read_text())["sizing"]
    assert doc["replay"] == "cache" and not doc["checked"]
    (c,) = doc["curves"]
    assert all(
        p["optimal_hit_rate"] >= max(p["lru_hit_rate"], p["fifo_hit_rate"]) for p in c["bound"]
    )
    w = read_trace(mooncake_trace, limit=300, ms_per_step=20.0, trace_format="auto")
    curve = block_curve(w, 512)
    assert c["mrc_info"]["unbounded_hit_rate"] == curve.unbounded_hit_rate
    # The scheduled replay, asked for: the path --mrc-only took before, with its own words,
    # and a line comparing it with the pure cache replay (kept in --json either way).
    doc_path = tmp_path / "scheduled.json"
    rc, out, _ = _cli(
        capsys,
        *base,
        "--mrc-only",
        "--mrc-replay",
        "scheduled",
        "--no-progress",
        "--jobs",
        "1",
        "--json",
        str(doc_path),
    )
    assert rc == 0, out
    assert "miss-ratio curve, block size 512 (exact LRU stack distances" in out
    (line,) = [x for x in out.splitlines() if x.startswith("fidelity    B=512: a pure cache")]
    (f,) = json.loads(doc_path.read_text())["sizing"]["fidelity"]
    worst = max(abs(cache - sched) for _, sched, cache in f["sizes"])
    assert abs(f["largest_difference"]) == pytest.approx(worst)
    assert f["large"] == (worst >= 0.01)
    assert ("differs by up to" in line) == f["large"]
    for n, _, cache in f["sizes"]:
        assert cache == curve.hit_rate(n)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--mrc-replay", "cache"], "add --mrc-only"),
        (["--mrc-only", "--mrc-replay", "cache", "--block-size", "24"], "neither divides"),
        (["--mrc-only", "--mrc-replay", "scheduled", "--mrc-warmup", "0.5"], "--mrc-warmup"),
        (["--mrc-only", "--mrc-replay", "cache", "--check"], "drop --check"),
        (["--mrc-only", "--mrc-replay", "cache", "--mrc-sample", "0.5"], "drop --mrc-sample"),
    ],
)
def test_replay_options_refused_where_they_cannot_hold(
    capsys: pytest.CaptureFixture[str], mooncake_trace: Path, extra: list[str], named: str
) -> None:
    rc, _, err = _cli(capsys, "simulate", "--trace", str(mooncake_trace), "--limit", "20", *extra)
    assert rc != 0
    assert named in err, err


def test_auto_takes_the_scheduled_replay_when_its_runs_are_asked_for(
    capsys: pytest.CaptureFixture[str], mooncake_trace: Path
) -> None:
    rc, out, _ = _cli(
        capsys,
        "simulate",
        "--trace",
        str(mooncake_trace),
        "--limit",
        "40",
        "--block-size",
        "512",
        "--mrc-only",
        "--check",
        "--no-progress",
        "--jobs",
        "1",
    )
    assert rc == 0, out
    assert "invariants  OK" in out and "pure cache replay of the trace's ids" not in out


def test_cache_replay_needs_hash_ids(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "simulate", "--requests", "10", "--mrc-only", "--mrc-replay", "cache")
    assert rc != 0
    assert "needs a trace of hash ids" in err and "carry tokens, not hash ids" in err, err
    with pytest.raises(SystemExit):
        main(["simulate", "--requests", "10", "--mrc-only", "--mrc-warmup", "1"])
