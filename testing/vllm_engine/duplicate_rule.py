"""vLLM's own KV-cache manager with pagedkv's one deliberate caching difference grafted on:
a block computed twice is cached once (docs/vllm.md, "Deliberate differences from vLLM's
manager"). A full block whose key another block already holds in vLLM's prefix cache stays
unhashed, as pagedkv leaves its copy; everything else (hit rules, release, eviction order:
vLLM already frees unhashed blocks to the front of its queue) is vLLM's.

This is the oracle for comparing hits with duplicates accounted for: where pagedkv and vLLM
differ only by that rule, pagedkv's schedule and hits equal this manager's exactly
(tests/vllm/test_window_hits.py under vLLM's scheduler; tests/engine with the window model
inside the CPU engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Duplicates:
    """The keys a block was left unhashed for while the rule was on."""

    def __init__(self) -> None:
        self.keys: list[Any] = []


def install() -> Duplicates:
    """Install the rule in vLLM's `BlockPool` for the rest of the process (an engine process
    of its own); returns the record of duplicates left unhashed."""
    from vllm.v1.core.block_pool import BlockPool

    if getattr(BlockPool, "_pagedkv_duplicates", None) is not None:
        raise RuntimeError("pagedkv's duplicate rule is already installed in vLLM's BlockPool")
    original = BlockPool._insert_block_hash
    seen = Duplicates()

    def insert_once(self: Any, key: Any, block: Any, num_tokens: int | None) -> None:
        # A fresh block (no hash yet) whose content another block already holds under this
        # key: pagedkv's index keeps one block per key, the copy stays unhashed.
        if (
            block.block_hash is None
            and self.cached_block_hash_to_block.get_one_block(key) is not None
        ):
            seen.keys.append(key)
            return
        original(self, key, block, num_tokens)

    BlockPool._insert_block_hash = insert_once
    BlockPool._pagedkv_duplicates = (original, seen)
    return seen


def uninstall() -> None:
    from vllm.v1.core.block_pool import BlockPool

    installed = getattr(BlockPool, "_pagedkv_duplicates", None)
    if installed is None:
        raise RuntimeError("pagedkv's duplicate rule is not installed in vLLM's BlockPool")
    BlockPool._insert_block_hash = installed[0]
    BlockPool._pagedkv_duplicates = None


@contextmanager
def duplicate_rule() -> Iterator[Duplicates]:
    """The rule on inside the block (for tests that run both managers in one process)."""
    seen = install()
    try:
        yield seen
    finally:
        uninstall()


__all__ = ["Duplicates", "duplicate_rule", "install", "uninstall"]
