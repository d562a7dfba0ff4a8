"""The manager without numpy (issue 32, item 12; docs/inputs.md): lists, tuples and ranges
need no numpy, and a call whose result is an array raises an `ImportError` before it changes
anything. The binding's numpy calls used to panic (`PanicException`) when numpy could not be
imported, even for a list. Each case runs in a child process whose numpy import fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCKERS = {
    # numpy's import halted: `None` in `sys.modules`
    "none_in_modules": "sys.modules['numpy'] = None",
    # numpy not found: a finder ahead of the others refuses it and its submodules
    "finder": textwrap.dedent(
        """
        class NoNumpy:
            def find_spec(self, name, path=None, target=None):
                if name == 'numpy' or name.startswith('numpy.'):
                    raise ModuleNotFoundError(f'no module named {name!r} (blocked)')
                return None
        sys.meta_path.insert(0, NoNumpy())
        """
    ),
}

BODY = """
import pagedkv
from pagedkv.errors import InvalidArgumentTypeError

assert 'numpy' not in sys.modules or sys.modules['numpy'] is None
m = pagedkv.BlockManager(16, 2, num_cpu_blocks=8)
assert m.allocate(1, [1, 2, 3, 4, 5]) == 0
assert m.allocate(2, (1, 2, 3, 4, 6)) == 4
assert m.allocate(3, range(7, 10), lookahead=1) == 0
assert m.append(1, [6]) == []
assert m.lookup([1, 2, 3, 4, 9]) == 4
m.fork(1, 4)
assert m.truncate(4, 3) is not None
assert m.block_table(1) and m.num_tokens(4) == 3
assert m.swap_out(2) is not None and m.swap_in(2) is not None
m.set_time(1.0)
for bad in ([1.5], [1, None], 'ab'):
    try:
        m.allocate(5, bad)
    except InvalidArgumentTypeError:
        pass
    else:
        raise AssertionError(f'{bad!r} accepted')
before = (m.num_tokens(1), m.block_table(1), m.stats().as_dict())
for call in (
    lambda: m.append_batch([1, 3], [7, 8]),
    lambda: m.block_tables([1]),
    lambda: m.slot_mapping([1], 1),
    lambda: m.flashinfer_page_table([1]),
    lambda: m.running_batch([1, 3]).step([7, 8]),
):
    try:
        call()
    except ImportError as e:
        assert 'needs numpy' in str(e), e
    else:
        raise AssertionError('an array without numpy')
assert (m.num_tokens(1), m.block_table(1), m.stats().as_dict()) == before, 'changed'
m.free_batch([1, 2, 3, 4])
m.check_invariants()
print('ok')
"""


@pytest.mark.parametrize("blocker", list(BLOCKERS))
def test_lists_work_and_arrays_raise_import_error_without_numpy(blocker: str) -> None:
    code = "import sys\n" + BLOCKERS[blocker] + "\n" + textwrap.dedent(BODY)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
