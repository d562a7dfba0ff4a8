"""Out of memory is a `MemoryError` with the state unchanged, never an abort.

Each case runs in a child process under an address-space limit (`RLIMIT_AS`), so that the
allocation really fails (without the limit Linux overcommits and a huge table would only
fail when touched). The child reports what it saw; an abort would show as a signal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

LIMIT = 3 << 30  # bytes of address space for the child: numpy and the extension fit


def run_limited(body: str) -> str:
    code = textwrap.dedent(
        f"""
        import resource
        import numpy as np
        import pagedkv
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
        """
    ) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (a negative code is a signal)\n{proc.stderr}"
    )
    return proc.stdout.strip()


@pytest.mark.parametrize("num_blocks", [10**8, 2**31 - 1])
def test_a_pool_too_large_for_memory_is_a_memory_error(num_blocks: int) -> None:
    out = run_limited(
        f"""
        try:
            pagedkv.BlockManager({num_blocks}, 16)
        except MemoryError as e:
            print("MemoryError", e)
        m = pagedkv.BlockManager(64, 16)  # the process is fine afterwards
        assert m.allocate(1, list(range(40))) == 0
        m.check_invariants()
        """
    )
    assert out.startswith("MemoryError") and "allocate" in out, out


def test_an_output_too_large_for_memory_is_a_memory_error_and_changes_nothing() -> None:
    out = run_limited(
        """
        m = pagedkv.BlockManager(1024, 16, enable_kv_events=True)
        assert m.allocate(7, np.arange(512 * 16, dtype=np.uint32)) == 0
        before = (m.stats(), m.block_table(7), m.drain_events())
        ids = np.full(2_000_000, 7, dtype=np.int64)  # 2e6 rows of 512 blocks: 4 GiB
        counts = np.full(len(ids), 8192)
        for call in (lambda: m.block_tables(ids), lambda: m.slot_mapping(ids, counts)):
            try:
                call()
                print("no error")
            except MemoryError:
                pass
        assert (m.stats(), m.block_table(7), m.drain_events()) == (before[0], before[1], [])
        m.check_invariants()
        print("ok")
        """
    )
    assert out == "ok", out
