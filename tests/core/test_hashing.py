"""Block digests against docs/hashing.md.

The digests are recomputed here with `hashlib` (and `xxhash`) by a tiny encoder written from
the spec, independently of both implementations, and compared with the Rust
`pagedkv.hash_blocks`, with the Rust manager's `block_hashes`, and with the pure-Python
reference. The test vectors are parsed out of docs/hashing.md, so the doc and the code cannot
drift apart.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv_reference import ReferenceBlockManager
from pagedkv_reference import hash_blocks as ref_hash_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "hashing.md"
ALGOS = ["sha256", "xxh3_128"]


# ------------------------------------------------------------------ independent encoder


def _h(algo: str, msg: bytes) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(msg).digest()
    return xxhash.xxh3_128(msg, seed=0).digest()  # canonical, big-endian


def spec_digests(
    tokens: list[int],
    block_size: int,
    *,
    cache_salt: str | bytes | None = None,
    lora_id: int | None = None,
    algo: str = "sha256",
    seed: int = 0,
) -> list[bytes]:
    """docs/hashing.md, written out byte by byte."""
    parent = _h(algo, b"PKV1root" + seed.to_bytes(8, "little"))
    salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else cache_salt
    out = []
    for i in range(len(tokens) // block_size):
        msg = bytearray(b"PKV1")
        msg += parent
        msg += block_size.to_bytes(4, "little")
        for t in tokens[i * block_size : (i + 1) * block_size]:
            msg += t.to_bytes(4, "little")
        msg.append((1 if salt is not None else 0) | (2 if lora_id is not None else 0))
        if salt is not None:
            msg += len(salt).to_bytes(4, "little") + salt
        if lora_id is not None:
            msg += lora_id.to_bytes(8, "little")
        parent = _h(algo, bytes(msg))
        out.append(parent)
    return out


# ------------------------------------------------------------------ the doc's vectors

VECTOR_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
VECTOR_BLOCK_SIZE = 4
_EXTRAS: dict[str, dict[str, Any]] = {
    "none": {},
    '`cache_salt="tenant-a"`': {"cache_salt": "tenant-a"},
    "`lora_id=7`": {"lora_id": 7},
    "`seed=1`": {"seed": 1},
}


def _doc_vectors() -> dict[tuple[str, str], list[bytes]]:
    """(hash_algo, extras label) -> digests, parsed from the table in docs/hashing.md."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Test vectors", 1)[1]
    assert "VECTORS" not in section, "the test-vector placeholder is not filled"
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (\d+) \| `([0-9a-f]+)` \|$", section, re.M)
    out: dict[tuple[str, str], list[bytes]] = {}
    for algo, extras, block, hexdigest in rows:
        digests = out.setdefault((algo, extras), [])
        assert int(block) == len(digests), f"rows of {algo} {extras} out of order"
        digests.append(bytes.fromhex(hexdigest))
    return out


VECTORS = _doc_vectors()
VECTOR_CASES = sorted(VECTORS)


def _kwargs(extras: str) -> dict[str, Any]:
    return dict(_EXTRAS[extras])


def test_doc_lists_every_case():
    assert set(VECTORS) == {(a, e) for a in ALGOS for e in _EXTRAS}
    for (algo, _), digests in VECTORS.items():
        assert len(digests) == 2
        assert all(len(d) == (32 if algo == "sha256" else 16) for d in digests)


@pytest.mark.parametrize(("algo", "extras"), VECTOR_CASES)
def test_doc_vectors_follow_the_spec(algo, extras):
    want = spec_digests(VECTOR_TOKENS, VECTOR_BLOCK_SIZE, algo=algo, **_kwargs(extras))
    assert VECTORS[(algo, extras)] == want


def test_doc_vectors_differ_from_each_other():
    all_digests = [d for ds in VECTORS.values() for d in ds]
    assert len(set(all_digests)) == len(all_digests)


@pytest.mark.parametrize(("algo", "extras"), VECTOR_CASES)
def test_doc_vectors_rust_hash_blocks(algo, extras):
    kw = _kwargs(extras)
    got = pagedkv.hash_blocks(
        VECTOR_TOKENS,
        VECTOR_BLOCK_SIZE,
        cache_salt=kw.get("cache_salt"),
        lora_id=kw.get("lora_id"),
        hash_algo=algo,
        seed=kw.get("seed", 0),
    )
    assert got == VECTORS[(algo, extras)]
    assert all(isinstance(d, bytes) for d in got)


@pytest.mark.parametrize(("algo", "extras"), VECTOR_CASES)
def test_doc_vectors_reference_hash_blocks(algo, extras):
    kw = _kwargs(extras)
    got = ref_hash_blocks(
        VECTOR_TOKENS,
        VECTOR_BLOCK_SIZE,
        cache_salt=kw.get("cache_salt"),
        lora_id=kw.get("lora_id"),
        hash_algo=algo,
        seed=kw.get("seed", 0),
    )
    assert got == VECTORS[(algo, extras)]


@pytest.mark.parametrize("impl", ["reference", "rust"])
@pytest.mark.parametrize(("algo", "extras"), VECTOR_CASES)
def test_doc_vectors_manager_block_hashes(impl, algo, extras):
    kw = _kwargs(extras)
    cls = ReferenceBlockManager if impl == "reference" else pagedkv.BlockManager
    m = cls(8, VECTOR_BLOCK_SIZE, hash_algo=algo, hash_seed=kw.get("seed", 0))
    m.allocate(0, VECTOR_TOKENS, cache_salt=kw.get("cache_salt"), lora_id=kw.get("lora_id"))
    assert m.block_hashes(0) == VECTORS[(algo, extras)]
    # Appending one token at a time reaches the same digests.
    m.allocate(1, VECTOR_TOKENS[:1], cache_salt=kw.get("cache_salt"), lora_id=kw.get("lora_id"))
    for t in VECTOR_TOKENS[1:]:
        m.append(1, [t])
    assert m.block_hashes(1) == VECTORS[(algo, extras)]


# ------------------------------------------------------------------ random inputs

salts = st.one_of(
    st.none(),
    st.text(max_size=12),
    st.binary(max_size=12),
)
loras = st.one_of(st.none(), st.integers(0, 2**64 - 1))


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    block_size=st.integers(1, 8),
    cache_salt=salts,
    lora_id=loras,
    algo=st.sampled_from(ALGOS),
    seed=st.integers(0, 2**64 - 1),
)
def test_random_inputs_match_the_spec(tokens, block_size, cache_salt, lora_id, algo, seed):
    want = spec_digests(
        tokens, block_size, cache_salt=cache_salt, lora_id=lora_id, algo=algo, seed=seed
    )
    assert len(want) == len(tokens) // block_size
    kw = {"cache_salt": cache_salt, "lora_id": lora_id, "hash_algo": algo, "seed": seed}
    arr = np.array(tokens, dtype=np.uint32)
    assert ref_hash_blocks(tokens, block_size, **kw) == want
    assert ref_hash_blocks(arr, block_size, **kw) == want
    assert pagedkv.hash_blocks(tokens, block_size, **kw) == want
    assert pagedkv.hash_blocks(arr, block_size, **kw) == want


@pytest.fixture(params=["reference", "rust"])
def hash_blocks(request: pytest.FixtureRequest) -> Any:
    """`pagedkv.hash_blocks` (Rust) and `pagedkv_reference.hash_blocks`."""
    return ref_hash_blocks if request.param == "reference" else pagedkv.hash_blocks


@pytest.mark.parametrize("algo", ALGOS)
def test_extra_keys_separate_digests(hash_blocks, algo):
    toks = [5, 6, 7, 8]
    plain = hash_blocks(toks, 4, hash_algo=algo)
    assert hash_blocks(toks, 4, cache_salt="t", hash_algo=algo) == hash_blocks(
        toks, 4, cache_salt=b"t", hash_algo=algo
    )
    variants = [
        plain,
        hash_blocks(toks, 4, cache_salt="", hash_algo=algo),  # an empty salt is still a salt
        hash_blocks(toks, 4, cache_salt="t", hash_algo=algo),
        hash_blocks(toks, 4, cache_salt="u", hash_algo=algo),
        hash_blocks(toks, 4, lora_id=0, hash_algo=algo),
        hash_blocks(toks, 4, lora_id=1, hash_algo=algo),
        hash_blocks(toks, 4, cache_salt="t", lora_id=1, hash_algo=algo),
        hash_blocks(toks, 4, seed=1, hash_algo=algo),
    ]
    assert len({tuple(v) for v in variants}) == len(variants)


def test_digests_chain_and_ignore_partial_blocks(hash_blocks):
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2
    assert a == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1], "block 1 has equal tokens but another parent: the digest must differ"
    assert hash_blocks([1, 2, 3], 4) == []
    assert hash_blocks([0, 2**32 - 1], 1) == spec_digests([0, 2**32 - 1], 1)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (([1, -1], 1), {}),
        (([1, 2**32], 1), {}),
        (([1.0, 2.0], 1), {}),
        (([1, 2], 0), {}),
        (([1, 2], 1), {"hash_algo": "md5"}),
        ((np.array([[1, 2]]), 1), {}),
        ((np.array([1.0, 2.0]), 1), {}),
    ],
)
def test_bad_arguments(hash_blocks, args, kwargs):
    with pytest.raises(InvalidArgumentError):
        hash_blocks(*args, **kwargs)
