"""`EngineRecord`, an engine adapter's per-request record (pagedkv.vllm's), on its own: a
decode step appends the request's new token with the keys of blocks that became full, grows
the table when a block is added, refuses what does not fit and bad input without changing
anything, and leaves calls that are not decode steps to the caller."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedkv import _core
from pagedkv.errors import InvalidArgumentError

BS = 4
UNCHANGED = object()


def _request(tokens: list[int], computed: int, hashes: list[bytes]) -> SimpleNamespace:
    # The attributes `decode` reads of a vLLM request.
    return SimpleNamespace(
        num_computed_tokens=computed,
        _all_token_ids=tokens,
        block_hashes=hashes,
        num_in_flight_tokens=0,
    )


def _keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 8 for i in range(n)]


def _record(m: _core.BlockManager, req: SimpleNamespace, n: int) -> _core.EngineRecord:
    m.allocate(1, req._all_token_ids[:n], block_hashes=_keys(n // BS))
    return _core.EngineRecord(
        m,
        req,
        1,
        n,
        n,
        n // BS,
        -(-n // BS),
        False,
        unchanged=UNCHANGED,
        offset=1,
        max_len=1 << 20,
        hash_ratio=1,
    )


def test_decode_steps_append_register_and_grow() -> None:
    m = _core.BlockManager(16, BS)
    tokens = list(range(100, 107))
    req = _request(tokens, 6, _keys(1))
    rec = _record(m, req, 7)
    # Token 7 fills block 1: its key is handed over, no entry is added.
    tokens.append(107)
    req.block_hashes = _keys(2)
    req.num_computed_tokens = 7
    out = rec.decode(req, 1, 0)
    assert out[0] is None and out[1] is None and out[3] == 1
    assert (rec.have, rec.scheduled, rec.nkeys, rec.table_len) == (8, 8, 2, 2)
    assert m.num_tokens(1) == 8
    # Token 8 starts block 2: one entry added, given in vLLM's ids (pagedkv's + 1).
    tokens.append(108)
    req.num_computed_tokens = 8
    first, ids, pairs, keys_from = rec.decode(req, 1, 0)
    assert (first, pairs, keys_from) == (2, [], None)
    assert ids == [[m.block_table(1)[2] + 1]]
    assert rec.table_len == 3
    # Nothing new to schedule and no block added: the shared result.
    assert rec.decode(req, 1, 0) is UNCHANGED


def test_calls_that_are_not_decode_steps_return_false() -> None:
    m = _core.BlockManager(16, BS)
    req = _request(list(range(8)), 7, _keys(2))
    rec = _record(m, req, 8)
    assert rec.decode(req, 0, 0) is False
    rec.held = True
    assert rec.decode(req, 1, 0) is False
    rec.held = False
    rec.scheduled = 4  # a prompt still in chunks
    assert rec.decode(req, 1, 0) is False


def test_a_step_that_does_not_fit_and_bad_input_change_nothing() -> None:
    m = _core.BlockManager(2, BS)
    tokens = list(range(8))
    req = _request(tokens, 7, _keys(2))
    rec = _record(m, req, 8)
    tokens.append(8)
    req.num_computed_tokens = 8
    before = (rec.have, rec.scheduled, rec.nkeys, rec.table_len)
    assert rec.decode(req, 1, 0) is None
    assert (rec.have, rec.scheduled, rec.nkeys, rec.table_len) == before
    assert m.num_tokens(1) == 8
    with pytest.raises(InvalidArgumentError, match="num_lookahead_tokens"):
        rec.decode(req, 1, -1)
    req.num_computed_tokens = "8"
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens"):
        rec.decode(req, 1, 0)
    req.num_computed_tokens = 8
    tokens[8] = -5
    with pytest.raises(InvalidArgumentError, match="token"):
        rec.decode(req, 0 + 1, 0)
    # Past the limits: a token id of 2**32, a count of 2**63.
    tokens[8] = 2**32
    with pytest.raises(InvalidArgumentError, match="token"):
        rec.decode(req, 1, 0)
    tokens[8] = 8
    req.num_computed_tokens = 2**63
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens"):
        rec.decode(req, 1, 0)
    req.num_computed_tokens = 8
    assert (rec.have, rec.scheduled, rec.nkeys, rec.table_len) == before
    assert m.num_tokens(1) == 8
    with pytest.raises(InvalidArgumentError, match="have"):
        rec.have = -1
    with pytest.raises(InvalidArgumentError, match="have"):
        rec.have = 2**63
