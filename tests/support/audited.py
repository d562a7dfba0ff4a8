"""Manager factories for tests: every manager a test builds is audited when the test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def audited(
    impl: Callable[..., Any],
    *,
    num_blocks: int | None = None,
    block_size: int | None = None,
    **kw: Any,
) -> Iterator[Callable[..., Any]]:
    """Yield `factory(num_blocks, block_size, **kw)` building `impl` managers (the given
    defaults fill what a call leaves out; keyword defaults are overridden by the call's), then
    `check_invariants` every manager it built."""
    made: list[Any] = []

    def factory(n: int | None = None, bs: int | None = None, /, **more: Any) -> Any:
        m = impl(num_blocks if n is None else n, block_size if bs is None else bs, **{**kw, **more})
        made.append(m)
        return m

    yield factory
    for m in made:
        m.check_invariants()
