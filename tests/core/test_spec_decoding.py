"""Speculative decoding in a mixed batch: a lookahead per sequence (issue 21, part C).

One forward pass verifies some sequences' drafts beside other sequences' prefill chunks, so
`slot_mapping(ids, n, lookahead=...)` and `flashinfer_page_table(ids, lookahead=...)` take
one lookahead for all or one per sequence (0 for a prefill). The expectations are written
out from each sequence's block table (slot `table[p // B] * B + p % B` of position `p`; the
first `ceil((s + k) / B)` pages, the last one holding `s + k - (pages - 1) * B`), and every
test runs against both implementations; the engine loop at the end also compares the two
call by call.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pagedkv
from audited import audited
from pagedkv import KVCacheGroup
from pagedkv.errors import (
    InvalidArgumentError,
    InvalidArgumentTypeError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv_reference import ReferenceBlockManager
from test_model_based import normalize

Manager = Any  # ReferenceBlockManager or pagedkv.BlockManager
B = 4
WINDOW = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=4)]


@pytest.fixture(params=["reference", "rust"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Manager]]:
    impl = pagedkv.BlockManager if request.param == "rust" else ReferenceBlockManager
    yield from audited(impl, num_blocks=32, block_size=B, enable_kv_events=True, watermark=0.0)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def slots(table: list[int], positions: range) -> list[int]:
    return [table[p // B] * B + p % B for p in positions]


def pages(table: list[int], n: int) -> tuple[list[int], int]:
    """The pages of `n` tokens and the last page's fill."""
    p = -(-n // B)
    return table[:p], n - (p - 1) * B


def expected_page_table(m: Manager, ids: list[int], las: list[int], group: int = 0) -> Any:
    indptr, indices, last = [0], [], []
    for sid, k in zip(ids, las, strict=True):
        row, fill = pages(m.block_table(sid, group=group), m.num_scheduled_tokens(sid) + k)
        indices += row
        indptr.append(len(indices))
        last.append(fill)
    return indptr, indices, last


def as_lists(t: Any) -> tuple[list[int], ...]:
    assert all(a.dtype == np.int32 for a in t)
    return tuple(a.tolist() for a in t)


def mixed_batch(m: Manager) -> tuple[list[int], list[int], list[int]]:
    """A step's batch: a decode whose 3 drafts cross into a new block, a prefill chunk of 6
    (no drafts), a decode whose 2 drafts end exactly at a block's end. Returns `(ids,
    num_new_tokens, lookahead)`."""
    assert m.allocate(1, toks(100, 3)) == 0
    assert m.append(1, [7], lookahead=3) == []  # s = 4: drafts at 4, 5, 6 (block 1)
    assert m.allocate(0, toks(0, 10), num_new_tokens=6) == 0  # s = 6 of 10, 2 blocks
    assert m.allocate(2, toks(200, 5)) == 0
    assert m.append(2, [8], lookahead=2) == []  # s = 6: drafts at 6, 7 (block 1 fills)
    assert [len(m.block_table(s)) for s in (1, 0, 2)] == [2, 2, 2]
    return [1, 0, 2], [1, 6, 1], [3, 0, 2]


LOOKAHEAD_FORMS: list[Callable[[list[int]], Any]] = [
    list,
    tuple,
    lambda v: np.array(v, dtype=np.int64),
    lambda v: np.array(v, dtype=">u2"),
    lambda v: np.repeat(np.array(v, dtype=np.int8), 2)[::2],  # strided
    lambda v: [np.int32(x) for x in v],
]


@pytest.mark.parametrize("form", range(len(LOOKAHEAD_FORMS)))
def test_mixed_batch_prefill_beside_decodes_with_drafts(make: Any, form: int) -> None:
    m = make()
    ids, counts, las = mixed_batch(m)
    arg = LOOKAHEAD_FORMS[form](las)
    t = {s: m.block_table(s) for s in ids}
    want = [
        *slots(t[1], range(3, 7)),  # the new token, then 3 drafts (4 and on: block 1)
        *slots(t[0], range(6)),  # the prefill chunk only
        *slots(t[2], range(5, 8)),  # the new token, then 2 drafts
    ]
    got = m.slot_mapping(ids, counts, lookahead=arg)
    assert got.dtype == np.int64
    assert got.tolist() == want
    # The same as one call per sequence, concatenated.
    each = zip(ids, counts, las, strict=True)
    assert want == [x for s, c, k in each for x in m.slot_mapping([s], c, lookahead=k).tolist()]
    table = as_lists(m.flashinfer_page_table(ids, lookahead=arg))
    assert table == (
        [0, 2, 4, 6],
        [*t[1], *t[0], *t[2]],
        [3, 2, 4],  # 4 + 3 = 7 tokens: 3 in page 2; 6 + 0: 2; 6 + 2 = 8: a full last page
    )
    assert table == expected_page_table(m, ids, las)


def test_one_lookahead_for_all_still_refuses_the_prefill(make: Any) -> None:
    """The issue's engine loop: `lookahead=3` for the whole batch asks the prefill (room 2)
    for slots it never reserved; the error names that sequence."""
    m = make()
    ids, counts, _ = mixed_batch(m)
    for call in (
        lambda: m.slot_mapping(ids, counts, lookahead=3),
        lambda: m.flashinfer_page_table(ids, lookahead=3),
    ):
        with pytest.raises(InvalidArgumentError, match=r"sequence 0\b"):
            call()
    # One int is still one lookahead for every sequence.
    assert m.slot_mapping([1, 2], 1, lookahead=2).tolist() == [
        *m.slot_mapping([1], 1, lookahead=[2]).tolist(),
        *m.slot_mapping([2], 1, lookahead=[2]).tolist(),
    ]
    assert as_lists(m.flashinfer_page_table([1, 2], lookahead=2)) == expected_page_table(
        m, [1, 2], [2, 2]
    )


def test_default_and_zero_lookahead_cover_the_scheduled_tokens(make: Any) -> None:
    m = make()
    ids, counts, _ = mixed_batch(m)
    plain = as_lists(m.flashinfer_page_table(ids))
    assert plain == expected_page_table(m, ids, [0, 0, 0])
    assert as_lists(m.flashinfer_page_table(ids, lookahead=[0, 0, 0])) == plain
    assert m.slot_mapping(ids, counts, lookahead=[0, 0, 0]).tolist() == (
        m.slot_mapping(ids, counts).tolist()
    )
    # A range is a sequence of ints too.
    assert m.slot_mapping([0, 1], [1, 1], lookahead=range(2)).tolist() == [
        *m.slot_mapping([0], 1).tolist(),
        *m.slot_mapping([1], 1, lookahead=1).tolist(),
    ]
    assert m.slot_mapping([], 1, lookahead=[]).tolist() == []
    assert as_lists(m.flashinfer_page_table([], lookahead=[])) == ([0], [], [])


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("reserved", [0, 1, 3, 4, 5])
def test_page_table_and_slots_at_block_boundaries(make: Any, n: int, reserved: int) -> None:
    """A decode after an `n`-token prompt with `reserved` draft slots: every lookahead up
    to the table's room gives the pages of `s + k` tokens (a draft run that crosses into a
    new block adds its page; one that ends at a block's end fills it), and one past the
    room is refused."""
    m = make()
    m.allocate(5, toks(0, n))
    assert m.append(5, [99], lookahead=reserved) == []
    s = n + 1
    table = m.block_table(5)
    assert len(table) == -(-(s + reserved) // B)
    room = len(table) * B - s
    assert room >= reserved
    for k in range(room + 1):
        row, fill = pages(table, s + k)
        got = as_lists(m.flashinfer_page_table([5], lookahead=[k]))
        assert got == ([0, len(row)], row, [fill]), (n, reserved, k)
        assert 1 <= fill <= B
        assert m.slot_mapping([5], 1, lookahead=[k]).tolist() == slots(table, range(s - 1, s + k))
    for call in (
        lambda: m.flashinfer_page_table([5], lookahead=[room + 1]),
        lambda: m.slot_mapping([5], 1, lookahead=np.array([room + 1])),
    ):
        with pytest.raises(InvalidArgumentError, match=r"sequence 5\b"):
            call()


def snapshot(m: Manager) -> Any:
    seqs = [s for s in range(8) if s in m]
    return (
        m.stats().as_dict(),
        [(m.num_tokens(s), m.is_swapped(s)) for s in seqs],
        [(m.block_table(s), m.num_scheduled_tokens(s)) for s in seqs if not m.is_swapped(s)],
        m.drain_events(),
    )


# (call, exception, message pattern): ids 1, 0, 2 are the mixed batch; 3 is swapped out.
BAD: list[tuple[str, type[Exception], str]] = [
    ("m.slot_mapping(ids, counts, lookahead=[3, 0])", InvalidArgumentError, "lookahead has 2"),
    ("m.slot_mapping(ids, counts, lookahead=[3, 0, 2, 0])", InvalidArgumentError, "has 4"),
    ("m.slot_mapping(ids, counts, lookahead=[])", InvalidArgumentError, "lookahead"),
    ("m.flashinfer_page_table(ids, lookahead=(3,))", InvalidArgumentError, "lookahead"),
    ("m.slot_mapping(ids, counts, lookahead=[3, -1, 2])", InvalidArgumentError, "-1"),
    ("m.flashinfer_page_table(ids, lookahead=np.array([3, 0, -2]))", InvalidArgumentError, "-2"),
    ("m.flashinfer_page_table(ids, lookahead=[0, 2**63, 0])", InvalidArgumentError, "lookahead"),
    ("m.slot_mapping(ids, counts, lookahead=[3, 1.0, 2])", InvalidArgumentTypeError, ""),
    ("m.slot_mapping(ids, counts, lookahead=[3, True, 2])", InvalidArgumentTypeError, ""),
    ("m.flashinfer_page_table(ids, lookahead=np.zeros((3, 1), int))", InvalidArgumentTypeError, ""),
    ("m.flashinfer_page_table(ids, lookahead=np.zeros(3))", InvalidArgumentTypeError, ""),
    (
        "m.flashinfer_page_table(ids, lookahead=np.ma.array([0, 0, 0]))",
        InvalidArgumentTypeError,
        "",
    ),
    ("m.flashinfer_page_table(ids, lookahead=None)", InvalidArgumentTypeError, "lookahead"),
    ("m.slot_mapping(ids, counts, lookahead=iter([3, 0, 2]))", InvalidArgumentTypeError, ""),
    ("m.slot_mapping(ids, counts, lookahead={3, 0, 2})", InvalidArgumentTypeError, ""),
    ("m.slot_mapping(ids, counts, lookahead='302')", InvalidArgumentTypeError, ""),
    # past a table's room: the first such sequence is named
    ("m.slot_mapping(ids, counts, lookahead=[3, 3, 2])", InvalidArgumentError, r"sequence 0\b"),
    ("m.flashinfer_page_table(ids, lookahead=[5, 0, 2])", InvalidArgumentError, r"sequence 1\b"),
    ("m.flashinfer_page_table(ids, lookahead=[4, 0, 3])", InvalidArgumentError, r"sequence 2\b"),
    # argument checks come before state checks; state checks go sequence by sequence
    ("m.slot_mapping([7, 1], 1, lookahead=[0])", InvalidArgumentError, "lookahead"),
    ("m.flashinfer_page_table([3, 1], lookahead=[0, -1])", InvalidArgumentError, "-1"),
    ("m.flashinfer_page_table([7, 1], lookahead=[0, 9])", UnknownSequenceError, ""),
    ("m.slot_mapping([3, 1], 1, lookahead=[0, 9])", SequenceSwappedError, ""),
    ("m.flashinfer_page_table([1, 3], lookahead=[9, 0])", InvalidArgumentError, r"sequence 1\b"),
    ("m.flashinfer_page_table([1], lookahead=[0], group=1)", InvalidArgumentError, "group"),
]


@pytest.mark.parametrize(("call", "exc", "pattern"), BAD)
def test_bad_lookahead_is_refused_and_changes_nothing(
    make: Any, call: str, exc: type[Exception], pattern: str
) -> None:
    m = make(num_cpu_blocks=4)
    ids, counts, _ = mixed_batch(m)
    m.allocate(3, toks(300, 2))
    assert m.swap_out(3) is not None
    m.drain_events()
    before = snapshot(m)
    with pytest.raises(exc) as info:
        eval(call, {"m": m, "ids": ids, "counts": counts, "np": np})
    assert type(info.value) is exc
    assert re.search(pattern, str(info.value)), str(info.value)
    assert snapshot(m) == before


# Every call that takes a lookahead, on sequence 1 (a prompt of 6, 3 scheduled) and 2 (a
# prompt of 3, all scheduled), and sequence 5 (new).
LOOKAHEAD_CALLS = [
    "m.allocate(5, toks(500, 3), lookahead=LA)",
    "m.extend(1, 1, lookahead=LA)",
    "m.append(2, [9], lookahead=LA)",
    "m.append(2, [], lookahead=LA)",
    "m.append_batch([2], [9], lookahead=LA)",
]
LAYOUTS = {"plain": None, "full": [KVCacheGroup("full")], "full+full": [KVCacheGroup("full")] * 2}


@pytest.mark.parametrize("la", [2**40, 2**63 - 1])
@pytest.mark.parametrize("call", LOOKAHEAD_CALLS)
@pytest.mark.parametrize("layout", [*LAYOUTS, "full+window"])
def test_a_lookahead_that_can_never_fit_is_out_of_blocks(
    make: Any, layout: str, call: str, la: int
) -> None:
    """No table is reserved for it first (a MemoryError with two groups): None, as for any
    call that does not fit, and nothing changes (docs/semantics.md, "Running out")."""
    groups = WINDOW if layout == "full+window" else LAYOUTS[layout]
    m = make(groups=groups) if groups else make()
    m.allocate(1, toks(100, 6), num_new_tokens=3)
    m.allocate(2, toks(200, 3))
    before = snapshot(m)
    assert eval(call, {"m": m, "toks": toks, "LA": la}) is None
    assert snapshot(m) == before


def test_groups_take_a_lookahead_per_sequence(make: Any) -> None:
    """Full attention beside a sliding window: each group's slots and pages cover the
    drafts in its own table (the window's released entries are the null block 0)."""
    m = make(groups=WINDOW)
    m.allocate(0, toks(0, 13), num_new_tokens=9)
    assert m.extend(0, 2) is not None  # prefill chunk 9..10: the window releases block 0
    m.allocate(1, toks(50, 9))
    assert m.append(1, [1], lookahead=3) is not None  # s = 10, drafts at 10..12 (block 3)
    ids, counts, las = [0, 1], [2, 1], [0, 3]
    assert m.block_table(0, group=1)[0] == 0
    for g in range(2):
        t0, t1 = m.block_table(0, group=g), m.block_table(1, group=g)
        assert m.slot_mapping(ids, counts, lookahead=las, group=g).tolist() == [
            *slots(t0, range(9, 11)),
            *slots(t1, range(9, 13)),
        ]
        got = as_lists(m.flashinfer_page_table(ids, lookahead=np.array(las), group=g))
        assert got == expected_page_table(m, ids, las, group=g)
        assert got[2] == [3, 1]  # 11 tokens: 3 in page 3; 10 + 3 = 13: 1 in page 4
        with pytest.raises(InvalidArgumentError, match=r"sequence 0\b"):
            m.flashinfer_page_table(ids, lookahead=[2, 0], group=g)


# ------------------------------------------------------------------ an engine loop, end to end


class Both:
    """The Rust manager and the reference, called together: equal answers or equal errors."""

    def __init__(self, **kw: Any) -> None:
        self.rust = pagedkv.BlockManager(**kw)
        self.ref = ReferenceBlockManager(**kw)
        self.calls = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            outs = []
            for m in (self.ref, self.rust):
                try:
                    outs.append(("ok", getattr(m, name)(*args, **kwargs)))
                except pagedkv.PagedKVError as e:
                    outs.append(("raised", type(e)))
            (kind, want), (kind2, got) = outs
            assert kind == kind2, (name, args, kwargs, outs)
            assert normalize(got) == normalize(want), (name, args, kwargs, got, want)
            if kind == "raised":
                raise want(f"{name} raised in both")
            return want

        return call


@pytest.mark.parametrize("groups", [None, WINDOW], ids=["plain", "full+window"])
@pytest.mark.parametrize("seed", range(4))
def test_spec_decoding_loop_matches_the_reference(groups: Any, seed: int) -> None:
    """Each step: admit prompts (a first chunk), schedule prefill chunks (`extend`), and
    give each decoding sequence a token plus `k` drafts (`append(.., lookahead=k)`); then one
    `slot_mapping` and one `flashinfer_page_table` with a lookahead per sequence cover the
    whole step. The drafts' slots must be the ones the accepted drafts then get when they
    are appended; `truncate` gives the rejected drafts' blocks back."""
    rng = random.Random(seed)
    kw: dict[str, Any] = {"num_blocks": 40, "block_size": B, "enable_kv_events": True}
    if groups is not None:
        kw["groups"] = groups
    m = Both(**kw)
    tokens: dict[int, list[int]] = {}
    prompt_len: dict[int, int] = {}
    next_id, steps_with_mix, accepted, crossings = 0, 0, 0, 0
    for _step in range(60):
        ids: list[int] = []
        counts: list[int] = []
        las: list[int] = []
        drafts: dict[int, list[int]] = {}
        if len(tokens) < 4 and rng.random() < 0.6:  # admission: the hit plus a chunk
            sid, next_id = next_id, next_id + 1
            prompt = [rng.randrange(4) for _ in range(rng.randint(2, 14))]
            c = rng.randint(1, len(prompt))
            hit = m.allocate(sid, prompt, num_new_tokens=c)
            if hit is not None:
                tokens[sid], prompt_len[sid] = prompt, len(prompt)
                ids.append(sid)
                counts.append(m.num_scheduled_tokens(sid) - hit)
                las.append(0)
        for sid in list(tokens):
            if sid in ids:
                continue
            s = m.num_scheduled_tokens(sid)
            if s < len(tokens[sid]):  # prefill chunk, no drafts
                c = rng.randint(1, len(tokens[sid]) - s)
                if m.extend(sid, c) is None:
                    continue
                ids.append(sid)
                counts.append(c)
                las.append(0)
            else:  # decode: one token plus k drafts
                k = rng.randint(0, 5)
                t = rng.randrange(4)
                if m.append(sid, [t], lookahead=k) is None:
                    continue
                tokens[sid].append(t)
                drafts[sid] = [rng.randrange(4) for _ in range(k)]
                ids.append(sid)
                counts.append(1)
                las.append(k)
        if not ids:
            continue
        steps_with_mix += 0 in las and any(las)
        order = rng.sample(range(len(ids)), len(ids))  # any batch order
        ids, counts, las = ([x[i] for i in order] for x in (ids, counts, las))
        form = rng.choice([list, tuple, np.array])
        mapping = m.slot_mapping(ids, counts, lookahead=form(las)).tolist()
        table = m.flashinfer_page_table(ids, lookahead=form(las))
        for g in range(len(groups or [0])):
            assert as_lists(m.rust.flashinfer_page_table(ids, lookahead=las, group=g)) == (
                expected_page_table(m.rust, ids, las, group=g)
            )
        assert as_lists(table) == expected_page_table(m.rust, ids, las)
        at = 0
        for sid, c, k in zip(ids, counts, las, strict=True):
            s = m.num_scheduled_tokens(sid)
            here = mapping[at : at + c + k]
            at += c + k
            assert here == slots(m.rust.block_table(sid), range(s - c, s + k))
            crossings += k > 0 and (s - 1) // B != (s + k - 1) // B
            if sid not in drafts:
                continue
            a = rng.randint(0, k)  # verification: the first `a` drafts are accepted
            if a:
                assert m.append(sid, drafts[sid][:a]) == []  # their slots are reserved
                tokens[sid] += drafts[sid][:a]
                accepted += a
                # their KV was written in the verification pass: the same slots
                assert m.slot_mapping([sid], a).tolist() == here[c : c + a]
            if k:
                assert m.truncate(sid, len(tokens[sid])) == []
                assert len(m.block_table(sid)) == -(-len(tokens[sid]) // B)
            if len(tokens[sid]) > prompt_len[sid] + 12 or rng.random() < 0.05:
                m.free(sid)
                del tokens[sid]
        m.rust.check_invariants()
        m.ref.check_invariants()
        m.stats()  # equal in both, and so are the events
        m.drain_events()
    assert steps_with_mix > 5 and accepted > 10 and crossings > 5, (
        steps_with_mix,
        accepted,
        crossings,
    )
