"""Trace formats beyond Mooncake's: Bailian (ids chained, follow-ups linked), Azure and BurstGPT
(no content ids: refused unless named), detection from the first line, --trace-format, and a
Bailian replay whose hit rate is counted here from the raw ids alone.

Every fixture is a few synthetic lines written here in the published formats."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv.__main__ import main
from pagedkv.sim import expected_hit_tokens, read_trace, run_workload
from pagedkv.sim.trace import (
    TRACE_FORMATS,
    TraceFormatError,
    TraceOrderWarning,
    TraceWarning,
    detect_trace_format,
)
from pagedkv.sim.trace_bailian import BAILIAN_BLOCK_TOKENS, chain_ids

B = BAILIAN_BLOCK_TOKENS


def _bailian(
    chat: int,
    parent: int,
    ts: float,
    ids: list[int],
    *,
    n: int | None = None,
    out: int = 2,
    kind: str = "text",
    turn: int = 1,
) -> dict[str, object]:
    return {
        "chat_id": chat,
        "parent_chat_id": parent,
        "timestamp": ts,
        "input_length": len(ids) * B if n is None else n,
        "output_length": out,
        "type": kind,
        "turn": turn,
        "hash_ids": ids,
    }


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# Ten seconds apart, short outputs: each request has finished before the next arrives, so a
# cache that never evicts serves exactly the blocks whose whole id prefix came before.
# Chat 3 repeats chat 0's blocks 1 and 2 after a different first block (no hit there); chat 1
# continues chat 0 (its history plus new text); chat 5 continues chat 1, with a partial block.
ROWS = [
    _bailian(0, -1, 0.0, [0, 1, 2]),
    _bailian(1, 0, 10.0, [0, 1, 2, 3, 4], turn=2),
    _bailian(2, -1, 20.5, [0, 1, 5], kind="search"),
    _bailian(3, -1, 30.25, [9, 1, 2]),
    _bailian(4, -1, 40.0, [0, 1, 2, 3, 4], n=4 * B + 3, out=0),
    _bailian(5, 1, 50.0, [0, 1, 2, 3, 4, 6, 7], n=6 * B + 9, kind="search", turn=3),
]


def _prefix_count(rows: list[dict[str, object]]) -> tuple[int, int]:
    """Hit and prompt tokens of a never-evicting 16-token-block cache, from the raw ids: a
    block is cached when an earlier prompt had it full behind the same ids."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        assert isinstance(ids, list) and isinstance(n, int)
        h = 0
        while h < (n - 1) // B and tuple(ids[: h + 1]) in seen:
            h += 1
        seen.update(tuple(ids[: k + 1]) for k in range(n // B))
        hits += h * B
        total += n
    return hits, total


def _naive_count(rows: list[dict[str, object]]) -> int:
    """Hit tokens if each id stood for its block alone (unchained): what must not happen."""
    seen: set[int] = set()
    hits = 0
    for r in rows:
        ids, n = r["hash_ids"], r["input_length"]
        assert isinstance(ids, list) and isinstance(n, int)
        hits += B * sum(1 for k in range((n - 1) // B) if ids[k] in seen)
        seen.update(ids[: n // B])
    return hits


@pytest.fixture
def bailian(tmp_path: Path) -> Path:
    return _write(tmp_path / "bailian.jsonl", ROWS)


def test_bailian_reads_to_the_expected_requests(bailian: Path) -> None:
    w = read_trace(bailian, ms_per_step=20)
    rs = w.requests
    assert [r.arrival_step for r in rs] == [0, 500, 1025, 1512, 2000, 2500]
    assert [r.prompt_len for r in rs] == [48, 80, 48, 48, 67, 105]
    assert [r.max_new_tokens for r in rs] == [2, 2, 2, 2, 1, 2]  # 0 still decodes one
    assert [r.after for r in rs] == [None, 0, None, None, None, 1]
    assert [r.delay for r in rs] == [0] * 6
    assert [r.kind for r in rs] == ["text", "text", "search", "text", "text", "search"]
    assert all(r.hash_block_tokens == B for r in rs)
    assert "Bailian" in w.name and w.ms_per_step == 20
    assert len(read_trace(bailian, limit=2).requests) == 2


def test_bailian_ids_are_chained(bailian: Path) -> None:
    """Equal id prefixes share chained ids and tokens; an equal id after a different prefix
    shares neither."""
    a, b, _, d, *_ = read_trace(bailian).requests
    assert a.hash_ids is not None and b.hash_ids is not None and d.hash_ids is not None
    assert np.array_equal(b.hash_ids[:3], a.hash_ids)
    assert not set(d.hash_ids.tolist()) & set(a.hash_ids.tolist())  # [9, 1, 2] vs [0, 1, 2]
    assert np.array_equal(chain_ids([0, 1, 2, 3])[:3], chain_ids([0, 1, 2]))
    assert len(set(chain_ids([7, 7, 7]).tolist())) == 3  # one id thrice: three prefixes
    assert int(chain_ids(list(range(1000))).min()) >= 0
    assert int(chain_ids(list(range(1000))).max()) < 2**63 // B  # id * 16 + 15 cannot wrap
    pa, pb, pd = a.prompt, b.prompt, d.prompt
    assert len(pa) == 48 and len(pb) == 80 and pa.dtype == np.uint32
    assert np.array_equal(pb[:48], pa)
    assert not np.array_equal(pd[B : 2 * B], pa[B : 2 * B])  # block 1: same id, other prefix
    assert len(set(pa[:B].tolist())) > 12  # pseudo-tokens vary within a block


@pytest.mark.parametrize("block_size", [8, 16, 32, 48])
def test_bailian_hit_count_matches_the_manager(bailian: Path, block_size: int) -> None:
    w = read_trace(bailian)
    m = BlockManager(4096, block_size)
    result = run_workload(m, w, check=True)
    assert m.stats().evictions == 0
    assert expected_hit_tokens(w.requests, block_size) == (
        result.prefix_hit_tokens,
        result.prompt_tokens,
    )
    if block_size == B:
        assert (result.prefix_hit_tokens, result.prompt_tokens) == _prefix_count(ROWS)


def test_simulate_on_a_bailian_file_gives_the_counted_hit_rate(
    capsys: pytest.CaptureFixture[str], bailian: Path, tmp_path: Path
) -> None:
    hits, total = _prefix_count(ROWS)
    assert hits == (3 + 2 + 4 + 5) * B  # chats 1, 2, 4 and 5; none for chat 3
    assert _naive_count(ROWS) > hits  # chat 3's blocks 1 and 2 would wrongly hit unchained
    js = tmp_path / "run.json"
    rc = main(["simulate", "--trace", str(bailian), "--block-size", "16", "--json", str(js)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "trace bailian.jsonl (Bailian): 6 requests (text 4, search 2" in out
    f = json.loads(js.read_text())
    assert (f["prefix_hit_tokens"], f["prompt_tokens"]) == (hits, total)
    assert f["prefix_hit_rate"] == pytest.approx(hits / total)


def test_follow_up_waits_for_its_parent_only_when_the_parent_ends_late(tmp_path: Path) -> None:
    """A follow-up logged 20 ms after its parent (which decodes 200 tokens) starts when the
    parent has finished; logged 20 s later it arrives at its own timestamp."""

    def clock(child_ts: float, parent: int) -> int:
        rows = [
            _bailian(0, -1, 0.0, [0, 1], out=200),
            _bailian(1, parent, child_ts, [0, 1, 2], out=100, turn=2),
        ]
        w = read_trace(_write(tmp_path / "f.jsonl", rows), ms_per_step=20)
        return run_workload(BlockManager(1024, 16), w).clock_steps

    alone = clock(0.02, -1)  # unrelated: runs alongside
    waits = clock(0.02, 0)
    assert 200 <= alone < 210
    assert waits >= alone + 100  # after its parent's 200 steps, then its own 100
    late, late_alone = clock(20.0, 0), clock(20.0, -1)
    assert late == late_alone  # the parent is long done: the timestamp alone decides
    assert 1100 <= late < 1110  # step 1000 + 100 decode steps


def test_bailian_orphans_and_order_warn(tmp_path: Path) -> None:
    rows = [
        _bailian(7, 3, 1.0, [0]),  # parent 3 is not in the file
        _bailian(8, -1, 0.5, [1]),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = read_trace(_write(tmp_path / "o.jsonl", rows))
    messages = [str(c.message) for c in caught]
    assert any("o.jsonl:1" in m and "parent_chat_id" in m for m in messages)
    assert any(
        "o.jsonl:2: timestamp 0.5 s is earlier than the line before it (1 s)" in m for m in messages
    )
    assert {c.category for c in caught} == {TraceWarning, TraceOrderWarning}
    assert [r.after for r in w.requests] == [None, None]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input_length": 3 * B + 1}, "does not match 3 hash ids of 16 tokens"),
        ({"timestamp": "0"}, "'timestamp' must be a number"),
        ({"timestamp": -0.5}, "'timestamp' must be a number >= 0"),
        ({"parent_chat_id": -2}, "'parent_chat_id' must be an integer >= -1"),
        ({"chat_id": None}, "'chat_id' must be an integer"),
        ({"type": 3}, "'type' must be a non-empty string"),
        ({"turn": 0}, "'turn' must be an integer >= 1"),
        ({"hash_ids": None}, "no 'hash_ids': without content ids"),
        ({"hash_ids": [0, -1, 2]}, "'hash_ids' must be a list of integers >= 0"),
        ({"hash_ids": [0, True, 2]}, "'hash_ids' must be a list of integers >= 0"),
        ({"hash_ids": [0, 2**63, 2]}, "'hash_ids' must be a list of integers >= 0"),
        ({"hash_ids": [0, 1.0, 2]}, "'hash_ids' must be a list of integers >= 0"),
    ],
)
def test_bad_bailian_lines(tmp_path: Path, change: dict[str, object], message: str) -> None:
    row = {**_bailian(0, -1, 0.0, [0, 1, 2]), **change}
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:1" in str(info.value)


def test_bailian_chat_ids_are_unique(tmp_path: Path) -> None:
    path = _write(tmp_path / "dup.jsonl", [_bailian(4, -1, 0, [0]), _bailian(4, -1, 1, [1])])
    with pytest.raises(ValueError, match=r"dup.jsonl:2: chat_id 4 appears twice"):
        read_trace(path)


# ---------------------------------------------------------------- detection and --trace-format

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + (
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,1100,0\n"
    "2023-11-16 18:15:51.1000000,20,9\n"
)
BURSTGPT = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + (
    "5.0,ChatGPT,472,18,490,Conversation log\n"
    "46,GPT-4,1087,0,1087,API log\n"
    "50,ChatGPT,0,0,0,Conversation log\n"
    "61.5,ChatGPT,33,7,40,Conversation log\n"
)
BURSTGPT_V2 = (
    "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,"
    "Log Type\n10.0,s-1,3,GPT-4,906,446,1352,Conversation log\n"
)
# Mooncake's tool-agent trace has the conversation trace's form: integer ms, 512-token ids
# naming prefixes; agent calls repeat a long tool-definition prefix (ids 0..3 here).
TOOLAGENT = [
    {"timestamp": 0, "input_length": 2100, "output_length": 40, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 150, "input_length": 2300, "output_length": 12, "hash_ids": [0, 1, 2, 3, 5]},
    {"timestamp": 3000, "input_length": 2560, "output_length": 0, "hash_ids": [0, 1, 2, 3, 5]},
    {"timestamp": 9000, "input_length": 700, "output_length": 80, "hash_ids": [6, 7]},
]


@pytest.fixture
def files(tmp_path: Path, bailian: Path) -> dict[str, Path]:
    out = {"bailian": bailian, "mooncake": _write(tmp_path / "toolagent.jsonl", TOOLAGENT)}
    for name, text in (("azure", AZURE), ("burstgpt", BURSTGPT), ("burstgpt2", BURSTGPT_V2)):
        out[name] = tmp_path / f"{name}.csv"
        out[name].write_text(text, encoding="utf-8")
    return out


def test_detection(files: dict[str, Path], tmp_path: Path) -> None:
    assert {k: detect_trace_format(p) for k, p in files.items()} == {
        "bailian": "bailian",
        "mooncake": "mooncake",
        "azure": "azure",
        "burstgpt": "burstgpt",
        "burstgpt2": "burstgpt",
    }
    bom = tmp_path / "bom.csv"
    bom.write_text(AZURE, encoding="utf-8-sig")  # a spreadsheet's export
    assert detect_trace_format(bom) == "azure"
    with pytest.warns(TraceWarning, match="no content ids"):
        assert len(read_trace(bom, trace_format="azure").requests) == 3
    odd = tmp_path / "odd.jsonl"
    odd.write_text('\n{"prompt": "hi", "ts": 0}\n', encoding="utf-8")
    assert detect_trace_format(odd) is None
    odd.write_text("time,tokens\n0,5\n", encoding="utf-8")
    assert detect_trace_format(odd) is None
    with pytest.raises(TraceFormatError) as info:
        read_trace(odd)
    msg = str(info.value)
    assert "cannot tell the trace's format" in msg
    for name in TRACE_FORMATS[1:]:
        assert f"{name}: " in msg
    for key in ("chat_id", "parent_chat_id", "hash_ids", "ContextTokens", "Request tokens"):
        assert key in msg


def test_the_tool_agent_trace_form_reads_as_mooncake(files: dict[str, Path]) -> None:
    for fmt in ("auto", "mooncake"):
        w = read_trace(files["mooncake"], trace_format=fmt)
        assert [r.arrival_step for r in w.requests] == [0, 7, 150, 450]
        assert [r.hash_block_tokens for r in w.requests] == [512] * 4
    m = BlockManager(4096, 16)
    result = run_workload(m, w)
    # request 1 hits the shared 4-id prefix; request 2 all of request 1's full prompt blocks
    assert result.prefix_hit_tokens == 4 * 512 + 2300 // 16 * 16
    assert expected_hit_tokens(w.requests, 16)[0] == result.prefix_hit_tokens


@pytest.mark.parametrize(
    ("name", "fmt", "label"),
    [
        ("azure", "azure", "an Azure LLM inference trace"),
        ("burstgpt", "burstgpt", "a BurstGPT trace"),
        ("burstgpt2", "burstgpt", "a BurstGPT trace"),
    ],
)
def test_no_content_ids_are_refused_with_what_they_can_answer(
    files: dict[str, Path], name: str, fmt: str, label: str
) -> None:
    with pytest.raises(TraceFormatError) as info:
        read_trace(files[name])
    msg = str(info.value)
    assert f"this is {label}" in msg
    assert "no content ids" in msg and "cannot estimate prefix-cache hit rates" in msg
    assert "load and concurrency" in msg
    assert "Refused by default" in msg and f"--trace-format {fmt}" in msg


def test_named_no_content_id_formats_replay_every_prompt_unique(files: dict[str, Path]) -> None:
    with pytest.warns(TraceWarning, match="hit rate is 0 by construction"):
        az = read_trace(files["azure"], trace_format="azure")
    assert [r.prompt_len for r in az.requests] == [374, 1100, 20]
    assert [r.max_new_tokens for r in az.requests] == [44, 1, 9]
    assert [r.arrival_step for r in az.requests] == [0, 215, 220]  # 4.314 s, 4.419 s
    with pytest.warns(TraceWarning, match="rows with 0 prompt tokens skipped: 1"):
        bg = read_trace(files["burstgpt"], trace_format="burstgpt", ms_per_step=1000)
    assert [r.prompt_len for r in bg.requests] == [472, 1087, 33]
    assert [r.arrival_step for r in bg.requests] == [0, 41, 56]
    for w in (az, bg):
        assert "no content ids" in w.name
        ids = np.concatenate([r.hash_ids for r in w.requests if r.hash_ids is not None])
        assert len(set(ids.tolist())) == len(ids)  # no block id repeats: nothing shared
        result = run_workload(BlockManager(1024, 16), w)
        assert result.prefix_hit_tokens == 0 and result.finished_requests == len(w.requests)


def test_a_named_format_that_is_not_the_files_is_an_error(files: dict[str, Path]) -> None:
    for fmt, path, found in (
        ("mooncake", files["bailian"], "Bailian"),
        ("bailian", files["mooncake"], "Mooncake"),
        ("azure", files["burstgpt"], "BurstGPT"),
        ("burstgpt", files["bailian"], "Bailian"),
    ):
        with pytest.raises(TraceFormatError) as info:
            read_trace(path, trace_format=fmt)
        msg = str(info.value)
        assert f"--trace-format {fmt} expects" in msg and f"the first line is {found}'s" in msg
    with pytest.raises(ValueError, match="trace_format must be one of auto, mooncake, bailian"):
        read_trace(files["bailian"], trace_format="csv")


def test_cli_trace_format(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    def run(*argv: str) -> tuple[int, str, str]:
        rc = main(["simulate", *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    rc, _, err = run("--trace", str(files["bailian"]), "--trace-format", "mooncake")
    assert rc == 2 and "--trace-format mooncake expects" in err
    rc, _, err = run("--trace", str(files["azure"]))
    assert rc == 2 and "no content ids" in err and "--trace-format azure" in err
    rc, out, err = run("--trace", str(files["azure"]), "--trace-format", "azure")
    assert rc == 0 and "warning:" in err and "hit rate is 0 by construction" in err
    assert "no content ids: every prompt unique" in out
    rc, _, err = run("--trace-format", "bailian", "--requests", "5")
    assert rc == 2 and "--trace-format applies to --trace only" in err
    with pytest.raises(SystemExit):
        run("--trace", str(files["bailian"]), "--trace-format", "csv")
    assert "invalid choice" in capsys.readouterr().err
