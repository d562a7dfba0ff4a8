"""KVCachePool with KV-cache groups: the layer -> group map, shared rows, the null block,
state layers, and the checks that a layer is given its own group's tables and slots.

Runs on the CPU torch path ("cpu") and, where a call launches a kernel, on the C++ host
harness ("host") as well.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.device.pool import KVCachePool, paged_decode_attention, swap_blocks  # noqa: E402
from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.groups import KVCacheGroup  # noqa: E402

BS = 8
FULL2 = KVCacheGroup("full", num_layers=2)
SW2 = KVCacheGroup("sliding_window", window=16, num_layers=2)


def make(where: str = "cpu", **kw: Any) -> KVCachePool:
    """4 layers alternating full / sliding window (16), 12 blocks of 8 tokens, fp32."""
    args: dict[str, Any] = {"groups": [FULL2, SW2], "layer_groups": [0, 1, 0, 1]}
    args.update(kw)
    launcher = None
    if where == "host":
        from test_kernels import _host_launcher

        launcher = _host_launcher()
    return KVCachePool(
        args.pop("num_layers", 4), 12, BS, 1, 64, "float32", "cpu", launcher=launcher, **args
    )


def kv(n: int, seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, 1, 64), generator=g), torch.randn((n, 1, 64), generator=g)


# ---- construction -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"groups": None}, "layer_groups= needs groups="),
        ({"layer_groups": None}, "groups= needs layer_groups="),
        ({"layer_groups": [0, 1, 0]}, "3 entries for 4 layers"),
        ({"layer_groups": [0, 1, 0, 2]}, r"layer_groups\[3\] = 2 is not a group index"),
        ({"layer_groups": [0, 1, 0, True]}, r"layer_groups\[3\] must be an int"),
        ({"layer_groups": "0101"}, "must be a list of group indices"),
        ({"layer_groups": [0, 1, 1, 1]}, "maps 1 layers to group 0 but groups.0..num_layers is 2"),
        ({"groups": []}, "groups must not be empty"),
        ({"groups": [FULL2, KVCacheGroup("full", block_size=16, num_layers=2)]}, "mixed block"),
        ({"groups": [FULL2, KVCacheGroup("sliding_window", window=4, num_layers=2)]}, "window 4"),
        ({"state_shape": (4,)}, "no group is a state group"),
        ({"groups": [FULL2, KVCacheGroup("state", num_layers=2)]}, "pass state_shape="),
        (
            {"groups": [FULL2, KVCacheGroup("state", num_layers=2)], "state_shape": {0: (2,)}},
            r"entries for groups \[0\], the state groups are \[1\]",
        ),
        (
            {"groups": [FULL2, KVCacheGroup("state", num_layers=2)], "state_shape": (0, 3)},
            "positive ints",
        ),
        (
            # a K page is 8 * 64 floats = 2048 bytes
            {"groups": [FULL2, KVCacheGroup("state", num_layers=2)], "state_shape": (513,)},
            "takes 2052 bytes, more than the 2048 bytes",
        ),
    ],
)
def test_bad_layouts_raise(kw, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make(**kw)


def test_layers_of_different_groups_share_rows():
    """The j-th layer of each group uses row j: 4 layers in 2 groups of 2 take 2 rows."""
    pool = make()
    assert pool.buffer.shape == (2, 2, 12, BS, 1, 64)
    assert [pool.group_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert pool.key(0).data_ptr() == pool.key(1).data_ptr()
    assert pool.value(2).data_ptr() == pool.value(3).data_ptr() != pool.value(0).data_ptr()
    assert pool.bytes_per_block == KVCachePool.block_bytes(2, BS, 1, 64, "float32")
    assert pool.nbytes == pool.buffer.numel() * 4
    assert pool.null_block and "2 groups" in repr(pool)
    # a block belongs to one group at a time: the pages of blocks 3 (group 0) and 4 (group
    # 1) in the same row are disjoint
    k, v = kv(2)
    pool.write(0, k[:1], v[:1], np.array([3 * BS]), group=0)
    pool.write(1, k[1:], v[1:], np.array([4 * BS]), group=1)
    assert torch.equal(pool.key(0)[3, 0], k[0]) and torch.equal(pool.key(1)[4, 0], k[1])
    uneven = make(
        groups=[KVCacheGroup("full", num_layers=1), KVCacheGroup("full", num_layers=3)],
        layer_groups=[1, 0, 1, 1],
    )
    assert uneven.buffer.shape[0] == 3 and uneven.layout.layer_row == (0, 0, 1, 2)
    mem = KVCachePool.from_memory(
        4, BS, 1, 64, "float32", "cpu", max_blocks=5, groups=[FULL2, SW2], layer_groups=[0, 1] * 2
    )
    assert mem.num_blocks == 5 and mem.buffer.shape[0] == 2


def test_without_groups_nothing_changes():
    pool = KVCachePool(3, 4, BS, 1, 64, "float32", "cpu")
    assert pool.buffer.shape[0] == 3 and not pool.null_block
    assert [pool.group_of(i) for i in range(3)] == [0, 0, 0]
    k, v = kv(1)
    pool.write(2, k, v, np.array([0]))  # block 0 is a block like any other
    pool.write(2, k, v, np.array([1]), group=0)
    with pytest.raises(InvalidArgumentError, match="this pool has no groups"):
        pool.write(2, k, v, np.array([2]), group=1)
    pool.copy_blocks(np.array([[0, 1]]))
    out = paged_decode_attention(torch.ones((1, 1, 64)), pool, 2, np.array([[1]]), np.array([2]))
    assert torch.isfinite(out).all()


# ---- each layer takes its own group's tables and slots ----------------------------------


@pytest.mark.parametrize("where", ["cpu", "host"])
def test_group_argument_is_checked(where):
    pool = make(where)
    k, v = kv(1)
    q = torch.ones((1, 2, 64))
    tables, lens = np.array([[1, 2]]), np.array([10])
    with pytest.raises(InvalidArgumentError, match=r"pass group=.*layer 1 \(group 1, sliding"):
        pool.write(1, k, v, np.array([9]))
    with pytest.raises(InvalidArgumentError, match=r"layer 1 \(group 1, .*\) is given group 0"):
        pool.write(1, k, v, np.array([9]), group=0)
    with pytest.raises(InvalidArgumentError, match=r"layer 2 \(group 0, full\) is given group 1"):
        pool.gather(2, tables, np.array([0, 10]), group=1)
    with pytest.raises(InvalidArgumentError, match="is given group 0"):
        paged_decode_attention(q, pool, 3, tables, lens, group=0)
    with pytest.raises(InvalidArgumentError, match="pass group="):
        paged_decode_attention(q, pool, 0, tables, lens)
    with pytest.raises(InvalidArgumentError, match="group must be an int"):
        paged_decode_attention(q, pool, 0, tables, lens, group=True)
    before = pool.buffer.clone()
    with pytest.raises(InvalidArgumentError, match="null block 0, which is never copied"):
        pool.copy_blocks(np.array([[0, 5]]))
    with pytest.raises(InvalidArgumentError, match="null block 0, which is never copied"):
        pool.copy_blocks(np.array([[5, 0]]))
    assert torch.equal(pool.buffer, before)
    assert paged_decode_attention(q, pool, 2, tables, lens, group=np.int64(0)).shape == q.shape


@pytest.mark.parametrize("where", ["cpu", "host"])
def test_slots_in_the_null_block_are_skipped(where):
    """The manager maps positions a group released into block 0 (docs/semantics.md); a
    write skips them like -1 (several may share a slot there), and writes the rest. The
    kernel skips them in device ids too (device_ops.write's first_slot)."""
    pool = make(where)
    k, v = kv(4, seed=3)
    pool.write(1, k, v, np.array([2, 10, 2, 11]), group=1)  # slot 2 twice: both released
    assert (pool.buffer[:, :, 0] == 0).all()
    assert torch.equal(pool.key(1)[1, 2:4], k[[1, 3]]) and torch.equal(pool.value(1)[1, 3], v[3])
    if where == "host":
        from pagedkv.device import device_ops

        dev_slots = torch.tensor([5, 12], dtype=torch.int64)  # as a device tensor would hold
        before = pool.buffer.clone()
        device_ops.write(
            pool._launcher, "float32", pool.key(0), pool.value(0), k[:2], v[:2], dev_slots, BS
        )
        assert (pool.buffer[:, :, 0] == 0).all()
        assert torch.equal(pool.key(0)[1, 4], k[1])
        before[0, :, 1, 4] = pool.buffer[0, :, 1, 4]
        assert torch.equal(pool.buffer, before)


@pytest.mark.parametrize("where", ["cpu", "host"])
@pytest.mark.parametrize("layout", ["full", "full+full"])
def test_block_0_is_a_block_when_every_group_is_full_attention(where, layout):
    """Issue 32, item 2: with `groups=[full]` or `[full, full]` the manager has no null
    block and hands out block 0 (`pagedkv.groups.has_null_block`, its rule), so the pool's
    block 0 is a block like any other: writes to it read back (they were dropped, zeros
    read back), it is gathered and attended to, copied and swapped. The launcher's write
    kernel gets no null block to skip either (first_slot 0)."""
    from pagedkv import BlockManager

    if layout == "full":
        groups, lg = [KVCacheGroup("full", num_layers=4)], [0] * 4
    else:
        groups, lg = [FULL2, FULL2], [0, 1, 0, 1]
    pool = make(where, groups=groups, layer_groups=lg)
    m = BlockManager(12, BS, groups=groups)
    assert m.allocate(0, list(range(3 * BS))) == 0
    assert m.block_table(0) == [0, 1, 2], "the manager hands out block 0"
    k, v = kv(3 * BS, seed=5)
    for layer in range(4):
        g = lg[layer]
        slots = m.slot_mapping([0], 3 * BS, group=g)
        pool.write(layer, k, v, slots, group=g)
        assert torch.equal(pool.key(layer)[0], k[:BS]) and torch.equal(pool.value(layer)[0], v[:BS])
        gk, gv = pool.gather(
            layer, np.array([m.block_table(0, group=g)]), np.array([0, 3 * BS]), group=g
        )
        assert torch.equal(gk, k) and torch.equal(gv, v)
    q = torch.randn((1, 1, 64), generator=torch.Generator().manual_seed(2))
    table = np.array([m.block_table(0)], dtype=np.int32)
    out = paged_decode_attention(q, pool, 0, table, np.array([3 * BS]), group=0)
    scores = (k[:, 0] @ q[0, 0]) / 8.0
    want = torch.softmax(scores, 0) @ v[:, 0]
    assert torch.allclose(out[0, 0], want, atol=1e-5)
    pool.copy_blocks(np.array([[0, 7]]))
    assert torch.equal(pool.buffer[:, :, 7], pool.buffer[:, :, 0])
    swap = pool.swap_pool(2)
    swap_blocks(pool, swap, np.array([[0, 1]]))
    pool.buffer[:, :, 0] = 0.0
    swap_blocks(swap, pool, np.array([[1, 0]]))
    assert torch.equal(pool.buffer[:, :, 0], pool.buffer[:, :, 7])


@pytest.mark.parametrize("where", ["cpu", "host"])
def test_gather_with_null_entries(where):
    """A full layer's table never holds the null block where it is read; a window layer's
    rows in released (null) entries come back as zeros (nothing writes block 0)."""
    pool = make(where)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)))
    pool.buffer[:, :, 0] = 0.0
    cu = np.array([0, 20])
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[0, 0\] is the null block"):
        pool.gather(0, np.array([[0, 3, 4]]), cu, group=0)
    k, v = pool.gather(1, np.array([[0, 3, 4]]), cu, group=1)
    assert (k[:BS] == 0).all() and (v[:BS] == 0).all()
    assert torch.equal(k[BS : 2 * BS], pool.key(1)[3]) and torch.equal(
        v[2 * BS :], pool.value(1)[4, :4]
    )


# ---- state layers -----------------------------------------------------------------------


def test_state_layers():
    groups = [FULL2, KVCacheGroup("state", num_layers=2)]
    pool = make(groups=groups, state_shape=(3, 5), state_dtype="float32")
    bf = make(groups=groups, state_shape={1: (4, 4)}, state_dtype="float32")
    assert pool.state(1).shape == (12, 3, 5) and pool.state(3).dtype == torch.float32
    assert bf.state(3).shape == (12, 4, 4)
    with pytest.raises(InvalidArgumentError, match=r"layer 1 \(group 1, state\) holds a state"):
        pool.key(1)
    with pytest.raises(InvalidArgumentError, match=r"layer 0 \(group 0, full\) is not a state"):
        pool.state(0)
    with pytest.raises(InvalidArgumentError, match="holds a state"):
        pool.write(1, *kv(1), np.array([9]), group=1)
    # block b's state is the start of block b's K page in the layer's row (row 0 for layer 1)
    st = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    pool.state(1)[6] = st
    assert torch.equal(pool.buffer[0, 0, 6].reshape(-1)[:15], st.reshape(-1))
    assert (pool.state(1)[5] == 0).all() and (pool.state(3)[6] == 0).all()
    pool.copy_blocks(np.array([[6, 2]]))
    assert torch.equal(pool.state(1)[2], st)
    swap = pool.swap_pool(3)
    assert not swap.null_block and swap.state(1).shape == (3, 3, 5)
    swap_blocks(pool, swap, np.array([[2, 0]]))  # CPU block 0 is a real block
    assert torch.equal(swap.state(1)[0], st)
    swap_blocks(swap, pool, np.array([[0, 9]]))
    assert torch.equal(pool.state(1)[9], st)
    with pytest.raises(InvalidArgumentError, match="never swapped"):
        swap_blocks(swap, pool, np.array([[0, 0]]))
    with pytest.raises(InvalidArgumentError, match="different layouts"):
        swap_blocks(pool, bf.swap_pool(3), np.array([[2, 0]]))
    half = KVCachePool(
        2,
        4,
        BS,
        1,
        64,
        "bfloat16",
        "cpu",
        groups=[KVCacheGroup("full"), KVCacheGroup("state")],
        layer_groups=[0, 1],
        state_shape=(256,),
        state_dtype="float32",
    )  # 1024 bytes of float32 state in a 1024-byte bf16 K page
    half.state(1)[3] = 1.5
    assert (half.state(1)[3] == 1.5).all() and (half.state(1)[2] == 0).all()
