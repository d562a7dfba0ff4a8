"""`help(pagedkv.BlockManager)` and Jupyter's `?` show each Rust method's doc and signature:
they come from the extension itself (doc comments and text signatures in rust/python/src),
not only from `_core.pyi`, which the interpreter never reads."""

from __future__ import annotations

import inspect
import pydoc

import pytest

import pagedkv
from pagedkv import _core

PUBLIC = sorted(n for n in dir(_core.BlockManager) if not n.startswith("_"))


def test_every_public_member_is_there() -> None:
    assert len(PUBLIC) > 30 and "allocate" in PUBLIC and "num_free_blocks" in PUBLIC


@pytest.mark.parametrize("name", PUBLIC)
def test_member_has_a_docstring(name: str) -> None:
    member = inspect.getattr_static(_core.BlockManager, name)
    doc = inspect.getdoc(member)
    assert doc and len(doc) > 10, name


@pytest.mark.parametrize("name", [n for n in PUBLIC if callable(getattr(_core.BlockManager, n))])
def test_method_has_a_signature(name: str) -> None:
    sig = inspect.signature(getattr(_core.BlockManager, name))
    assert "self" in sig.parameters, name


def test_help_shows_them() -> None:
    text = pydoc.render_doc(pagedkv.BlockManager, renderer=pydoc.plaintext)
    for needle in (
        "allocate(self, /, seq_id, token_ids, *, num_new_tokens=None",
        "Give a new sequence its blocks",
        "Returns the copy-on-write",
        "GPU blocks held by nobody and not cached.",
        "Paged KV-cache block manager",
    ):
        assert needle in text, needle
    assert inspect.signature(_core.BlockManager).parameters["block_size"].default == 16
