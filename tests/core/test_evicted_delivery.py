"""No eviction a call made is lost on its way to `evicted=` (issue 32, item 12;
docs/semantics.md, "Duties"). Each is a block the engine must copy out before reuse: they
are appended with `list.append` itself (a list subclass's override never runs), an append
that fails does not stop the rest, and the ones not appended come back in an
`EvictionsNotDeliveredError` with the call's own result. Before, the first failed append
raised and dropped the rest and the call's result (copy pairs included)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

import pagedkv
from pagedkv.errors import EvictionsNotDeliveredError
from pagedkv_reference import ReferenceBlockManager

IMPLS = [ReferenceBlockManager, pagedkv.BlockManager]


def cached(impl: Any) -> Any:
    """A manager whose 7 full cached blocks (of 8) the next prompt of 15 tokens evicts."""
    m = impl(8, 2, record_evictions=True)
    m.allocate(1, list(range(100, 115)))
    m.free(1)
    return m


class Refusing(list[Any]):
    """A caller's list whose own methods refuse everything."""

    def append(self, x: Any) -> None:
        raise RuntimeError("append refused")

    def extend(self, x: Any) -> None:
        raise RuntimeError("extend refused")

    def __iadd__(self, x: Any) -> Any:
        raise RuntimeError("+= refused")


@pytest.mark.parametrize("impl", IMPLS, ids=["reference", "rust"])
def test_a_list_subclass_s_methods_never_drop_an_eviction(impl: Any) -> None:
    plain: list[Any] = []
    assert cached(impl).allocate(2, list(range(200, 215)), evicted=plain) == 0
    assert len(plain) == 7
    m = cached(impl)
    mine = Refusing()
    assert m.allocate(2, list(range(200, 215)), evicted=mine) == 0
    assert list(mine) == plain
    m.check_invariants()


def test_the_reference_reports_the_evictions_it_could_not_append(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Appends 2 and 5 fail: the others are appended, those two and the call's result come
    back in the error, whose cause is the first failure."""
    import pagedkv_reference.duties  # the module this test patches

    calls = []

    def flaky(lst: list[Any], item: Any) -> None:
        calls.append(item)
        if len(calls) in (2, 5):
            raise MemoryError(f"append {len(calls)}")
        list.append(lst, item)

    monkeypatch.setattr(pagedkv_reference.duties, "_append", flaky)
    m = cached(ReferenceBlockManager)
    out: list[Any] = []
    with pytest.raises(EvictionsNotDeliveredError) as info:
        m.allocate(2, list(range(200, 215)), evicted=out)
    e = info.value
    assert len(calls) == 7, "every eviction tried"
    assert e.evicted == [calls[1], calls[4]]
    assert out == [c for i, c in enumerate(calls) if i not in (1, 4)]
    assert e.result == 0 and e.error is None
    assert isinstance(e.__cause__, MemoryError) and "append 2" in str(e.__cause__)
    assert 2 in m, "the call went through"
    m.check_invariants()


OUT_OF_MEMORY = """
import gc, resource
import pagedkv
from pagedkv.errors import EvictionsNotDeliveredError

m = pagedkv.BlockManager(8, 2, record_evictions=True)
m.allocate(1, list(range(100, 115)))
m.free(1)  # 7 full blocks cached: the next prompt evicts them
N = 20_000_000
out = [None] * N  # exactly N entries: the next append needs N / 8 more (20 MB)
with open('/proc/self/statm') as f:
    vm = int(f.read().split()[0]) * resource.getpagesize()
gc.disable()
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), hard))
try:
    m.allocate(2, list(range(200, 215)), evicted=out)
except EvictionsNotDeliveredError as e:
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    assert len(out) == N and len(e.evicted) == 7, (len(out) - N, len(e.evicted))
    assert all(isinstance(d, bytes) and len(d) == 32 for _, _, d in e.evicted)
    assert e.result == 0 and e.error is None, (e.result, e.error)
    assert isinstance(e.__cause__, MemoryError)
    assert 2 in m
    m.check_invariants()
    print('reported')
else:
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    print('appended', len(out) - N)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux only")
def test_evictions_the_binding_cannot_append_come_back_in_the_error() -> None:
    """Out of memory while the evictions are appended (a list that must grow by 20 MB with
    4 MB of address space left): the seven evictions and the call's result are in the
    error, and the allocation stands."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OUT_OF_MEMORY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "reported", proc.stdout
