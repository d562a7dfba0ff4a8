"""The forms a lookup's integer hashes may take (a list of ints, any buffer of 8-byte unsigned
ints, bytes of whole 8-byte hashes): each gives the same answer as the list, including hashes
above 2**63; bad ones raise a clear error; `scores` per medium and group."""

from __future__ import annotations

import array
import random

import numpy as np
import pytest

from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError
from pagedkv.events import BlockStored
from pagedkv.kv_events import WireEncoder
from pagedkv.router import RouterIndex

MASK = (1 << 64) - 1


def _chain(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    # Half above 2**63, as vLLM's hashes are; one at the very top of the range.
    out = [rng.getrandbits(64) for _ in range(n)]
    out[1] = MASK
    return out


def _payload(hashes: list[int], medium: str = "GPU", group: int = 0) -> bytes:
    digests = [h.to_bytes(8, "big") for h in hashes]  # an 8-byte digest's integer is itself
    return WireEncoder().batch([BlockStored(digests, None, [], 4, None, medium, group)])


@pytest.fixture
def index() -> tuple[RouterIndex, list[int]]:
    chain = _chain(1, 40)
    ix = RouterIndex()
    ix.apply("a", _payload(chain))
    ix.apply("b", _payload(chain[:25]))
    ix.apply("b", _payload(chain[:30], medium="CPU"))
    ix.apply("c", _payload(chain[:7], group=1))
    return ix, chain


def _forms(q: list[int]) -> dict[str, object]:
    arr = np.array(q, dtype=np.uint64)
    return {
        "ndarray": arr,
        "strided ndarray": np.repeat(arr, 2)[::2],
        "array('Q')": array.array("Q", q),
        "bytes": arr.tobytes(),
        "bytearray": bytearray(arr.tobytes()),
        "memoryview": memoryview(arr),
    }


def test_every_form_answers_as_the_list(index: tuple[RouterIndex, list[int]]) -> None:
    ix, chain = index
    for q in (chain, [*chain[:30], 5, 6], chain[:1], [3, *chain], []):
        want_holders = sorted(ix.match_hashes(q), key=str)
        want_scores = ix.scores(q)
        for name, form in _forms(q).items():
            assert sorted(ix.match_hashes(form), key=str) == want_holders, name  # type: ignore[arg-type]
            assert ix.scores(form) == want_scores, name  # type: ignore[arg-type]
    assert ix.scores(chain) == {"a": 40, "b": 25}


def test_scores_per_medium_and_group(index: tuple[RouterIndex, list[int]]) -> None:
    ix, chain = index
    assert ix.scores(chain, medium="CPU") == {"b": 30}
    assert ix.scores(chain, group=1) == {"c": 7}
    assert ix.scores(chain, medium=None) == {}
    assert ix.scores(chain, medium="disk") == {}


def test_bad_forms_raise_clearly(index: tuple[RouterIndex, list[int]]) -> None:
    ix, chain = index
    before = ix.stats()
    with pytest.raises(InvalidArgumentError, match="whole 8-byte hashes, got 12 bytes"):
        ix.scores(b"x" * 12)
    with pytest.raises(InvalidArgumentError, match="whole 8-byte hashes, got 3 bytes"):
        ix.match_hashes(bytearray(b"abc"))
    # Buffers of other items go the generic way, with its errors.
    with pytest.raises(InvalidArgumentTypeError, match="block_hashes must be"):
        ix.scores(array.array("d", [1.0]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
        ix.scores(np.array([-1], dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
        ix.scores([1, 1 << 64])
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*64\)"):
        ix.scores([1, -1])
    # A bad item past where the walk would stop raises all the same, for a request the index
    # holds (a long walk) and one it does not (none).
    for head in (chain, [5]):
        for bad in (-1, 1 << 64, "x"):
            with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError)):
                ix.scores([*head, *range(7, 40), bad])  # type: ignore[list-item]
            with pytest.raises((InvalidArgumentError, InvalidArgumentTypeError)):
                ix.match_hashes([*head, *range(7, 40), bad])  # type: ignore[list-item]
    assert ix.stats() == before
    ix.check_invariants()


def test_other_integer_buffers_are_read_exactly() -> None:
    ix = RouterIndex()
    ix.apply("d", _payload([1, 2, 3]))
    for dtype in (np.uint32, np.int64, np.uint16):
        assert ix.scores(np.array([1, 2, 3, 4], dtype=dtype)) == {"d": 3}, dtype
    # A buffer of other items that is not a numpy array is refused by name.
    with pytest.raises(InvalidArgumentTypeError, match="got array"):
        ix.scores(array.array("I", [1, 2]))
