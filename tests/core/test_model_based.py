"""Model-based test: the Rust `pagedkv.BlockManager` against the pure-Python reference.

A hypothesis state machine drives both managers through the same random calls on small pools
(few blocks, tiny block sizes, a tiny vocabulary so that prefix hits, duplicate content,
eviction, copy-on-write and swapping happen all the time), with chunked prefill
(`num_new_tokens`, `extend`), draft slots (`lookahead`; one per sequence in the batch
queries), `truncate`, retraction (`free(num_computed_tokens=...)`), `lookup`/`lookup_many`
and hit-aware `can_allocate`, caller-keyed sequences (`block_hashes=`, keys arriving late),
hit caps (`max_hit_tokens=`), held registration (`register=False`, `register`), slots
without tokens (`append([], lookahead=k)`), and the pool-level `evict_blocks`,
`allocation_cost` and `lookup_blocks`. Every return value, every exception class (exactly:
the same class, not merely "both raised"), every table, digest list, slot mapping, page
table, counter and event must be equal, and both managers must pass `check_invariants()`
after every step. Arguments come in every accepted form (lists, tuples,
ranges, arrays of any integer dtype and byte order) and in refused ones, and calls with several
faults at once are compared too: docs/inputs.md fixes which fault is reported. Table digests
differ between the implementations by design: within each one, equal tables must give equal
digests.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from kv_oracle import KVOracle
from pagedkv.errors import PagedKVError
from pagedkv_reference import ReferenceBlockManager

MAX_SEQ = 8  # sequence ids 0..7: unknown and duplicate ids come up often
# The calls that take blocks: with `record_evictions`, each reports its own evictions
# (`evicted=`), which must be the same blocks, groups and digests in both managers.
DUTIES = frozenset({"allocate", "extend", "append", "append_batch", "truncate", "fork", "swap_in"})

seq_ids = st.integers(0, MAX_SEQ - 1)
vocab = st.integers(0, 2)
tokens = st.lists(vocab, min_size=1, max_size=8)
short_tokens = st.lists(vocab, min_size=1, max_size=6)
salts = st.sampled_from([None, None, None, "a", b"a", "b", ""])
loras = st.sampled_from([None, None, None, 0, 5])
families = st.sampled_from([b"a", b"a", b"b"])  # key families: same tokens, other keys
max_hits = st.sampled_from([None, None, None, None, 0, 1, 2, 3, 5, 100])
# Keys short of the full blocks by this many (-1: one too many, refused).
short_by = st.sampled_from([0, 0, 0, 0, 1, 2, -1])


def caller_keys(family: bytes, toks: list[int], bs: int, lo: int, hi: int) -> list[bytes]:
    """Keys `lo .. hi - 1` of a caller that keys blocks by their prefix (chain keys, like
    vLLM's block hashes): equal prefixes in one family give equal keys."""
    return [
        family + hashlib.blake2b(bytes(toks[: (i + 1) * bs]), digest_size=15).digest()
        for i in range(lo, hi)
    ]


def normalize(x: Any) -> Any:
    """A comparable form that keeps types, dtypes and shapes."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, enum.Enum):
        return (type(x).__name__, x.name)
    if isinstance(x, int):
        return ("int", int(x))
    if isinstance(x, float):
        return ("float", x)
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tolist())
    if isinstance(x, tuple):
        return ("tuple", *(normalize(v) for v in x))
    if isinstance(x, list):
        return ["list", *(normalize(v) for v in x)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (
            type(x).__name__,
            *(normalize(getattr(x, f.name)) for f in dataclasses.fields(x)),
        )
    raise TypeError(f"cannot normalize {type(x).__name__}: {x!r}")


class Outcome:
    """What a call did: a normalized return value (and the value itself, `raw`), or the type
    of the exception it raised."""

    def __init__(
        self, value: Any = None, exc: BaseException | None = None, raw: Any = None
    ) -> None:
        self.value = value
        self.exc = exc
        self.raw = raw

    def describe(self) -> str:
        return repr(self.exc) if self.exc is not None else repr(self.value)

    def key(self) -> Any:
        return ("raised", type(self.exc)) if self.exc is not None else self.value


def run(m: Any, method: str, *args: Any, **kwargs: Any) -> Outcome:
    try:
        raw = getattr(m, method)(*args, **kwargs)
        return Outcome(value=normalize(raw), raw=raw)
    except Exception as e:  # compared below
        return Outcome(exc=e)


def _stats(m: Any) -> dict[str, Any]:
    return dict(m.stats().as_dict())


ODD_TOKENS: list[Callable[[list[int]], Any]] = [
    tuple,
    lambda t: np.array(t, dtype=">i8"),
    lambda t: np.array(t, dtype=">u4"),
    # uint32 arrays: contiguous ones are copied whole; strided and read-only ones too
    lambda t: np.array(t, dtype=np.uint32),
    lambda t: np.array(t + t, dtype=np.uint32)[::2],
    lambda t: np.frombuffer(np.array(t, dtype=np.uint32).tobytes(), dtype=np.uint32),
    lambda t: np.array(t, dtype=np.uint8),
    lambda t: np.array(t + t, dtype=np.int16)[::2],
    lambda t: [np.int32(x) for x in t],
]
ODD_IDS: list[Callable[[list[int]], Any]] = [
    tuple,
    lambda i: np.array(i, dtype=">u8"),
    lambda i: np.array(i, dtype=np.int8),
    lambda i: range(i[0], i[0] + 1) if len(i) == 1 else list(i),
]
# Refused kinds (docs/inputs.md): the same exception class from both.
REFUSED: list[Callable[[list[int]], Any]] = [
    lambda v: (x for x in v),
    lambda v: iter(v),
    lambda v: set(v),
    lambda v: bytearray(v),
    lambda v: memoryview(bytes(v)),
    lambda v: np.array(v, dtype=np.float64),
    lambda v: np.array(v, dtype=bool),
    lambda v: np.ma.array(v),
    lambda v: np.array(v[0] if v else 0),
    lambda v: [float(x) for x in v],
    lambda v: [True for _ in v],
    lambda v: "".join(map(str, v)),
]


class ManagerComparison(RuleBasedStateMachine):
    ref: ReferenceBlockManager
    rust: Any

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.history: list[tuple[list[int], Any, Any]] = []
        self.families: dict[int, bytes] = {}  # the key family of each keyed allocation
        self.keyed_history: list[tuple[list[int], bytes]] = []  # keyed prompts and families
        self.held: set[int] = set()  # allocated with register=False
        # The key family of the keyed allocation being made: its KV identity in the oracles.
        self.next_family: bytes | None = None

    @initialize(
        num_blocks=st.integers(6, 24),
        block_size=st.integers(1, 4),
        num_cpu_blocks=st.integers(0, 8),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
        hash_algo=st.sampled_from(["sha256", "xxh3_128"]),
        hash_seed=st.sampled_from([0, 1]),
        watermark=st.sampled_from([0.0, 0.01, 0.1, 0.25]),
        enable_kv_events=st.booleans(),
        record_evictions=st.booleans(),
    )
    def init(self, num_blocks: int, block_size: int, **kw: Any) -> None:
        self.records = kw["record_evictions"]
        self.ref = ReferenceBlockManager(num_blocks, block_size, **kw)
        self.rust = pagedkv.BlockManager(num_blocks, block_size, **kw)
        self.build_oracles(block_size)
        self.log.append(f"BlockManager({num_blocks}, {block_size}, **{kw!r})")

    def build_oracles(self, block_size: int) -> None:
        """The KV itself is the oracle: each manager drives its own shadow pool."""
        self.ref_kv = KVOracle(block_size)
        self.rust_kv = KVOracle(block_size)

    # ---------------------------------------------------------------- the comparison

    def both(self, method: str, *args: Any, **kwargs: Any) -> Outcome:
        """Call both; the outcomes (values, or exception classes) must be the same."""
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        self.log.append(f"{method}({shown})")
        duty = method in DUTIES and self.records and "evicted" not in kwargs
        ref_ev: list[Any] = []
        rust_ev: list[Any] = []
        self.ref_kv.before(self.ref, method, args, kwargs)
        self.rust_kv.before(self.rust, method, args, kwargs)
        want = run(self.ref, method, *args, **kwargs, **({"evicted": ref_ev} if duty else {}))
        got = run(self.rust, method, *args, **kwargs, **({"evicted": rust_ev} if duty else {}))
        extras = None if self.next_family is None else ("k", self.next_family)
        for kv, m, out, ev in (
            (self.ref_kv, self.ref, want, ref_ev),
            (self.rust_kv, self.rust, got, rust_ev),
        ):
            try:
                kv.after(m, method, args, kwargs, out.raw, out.exc, evicted=ev, extras=extras)
            except AssertionError as e:
                raise AssertionError(
                    f"{type(m).__name__} after {method}({shown}): {e}\n  after: "
                    + "\n  ".join(self.log)
                ) from None
        if want.exc is not None:
            assert isinstance(want.exc, PagedKVError), f"reference raised {want.exc!r}"
        assert got.key() == want.key(), (
            f"{method}({shown}): rust {got.describe()}, reference {want.describe()}"
            "\n  after: " + "\n  ".join(self.log)
        )
        assert normalize(rust_ev) == normalize(ref_ev), (
            f"{method}({shown}) evicted: rust {rust_ev}, reference {ref_ev}"
        )
        if want.exc is not None or want.value is None:
            assert ref_ev == [], "a call that fails or does not fit evicts nothing"
        return want

    # ---------------------------------------------------------------- rules

    def pick(self, data: st.DataObject, want: str) -> int:
        """A sequence id: mostly one that is `want` ("new", "resident", "swapped", "known",
        "partial": resident with prompt tokens left to schedule), sometimes any id, so that
        unknown, duplicate and swapped ids keep coming up."""
        ref = self.ref
        match = [
            s
            for s in range(MAX_SEQ)
            if {
                "new": s not in ref,
                "resident": s in ref and not ref.is_swapped(s),
                "swapped": s in ref and ref.is_swapped(s),
                "known": s in ref,
                "partial": s in ref
                and not ref.is_swapped(s)
                and ref.num_scheduled_tokens(s) < ref.num_tokens(s),
            }[want]
        ]
        if match and data.draw(st.integers(0, 9), label="pick_any") < 9:
            return data.draw(st.sampled_from(match), label=want)
        return data.draw(seq_ids, label="any id")

    def picks(self, data: st.DataObject, want: str, unique: bool = True) -> list[int]:
        n = data.draw(st.integers(0, 4), label="batch size")
        ids = [self.pick(data, want) for _ in range(n)]
        return list(dict.fromkeys(ids)) if unique else ids

    def remember(self, sid: int) -> None:
        """Keep the tokens and extra keys of a sequence, to build prompts that share them."""
        if sid in self.ref and len(self.history) < 32:
            seq = self.ref._seqs[sid]  # the reference's own record of the sequence
            self.history.append((list(seq.tokens), seq.salt, seq.lora_id))

    def do_allocate(
        self,
        sid: int,
        toks: list[int],
        salt: Any,
        lora: Any,
        lookahead: int,
        as_array: Any,
        chunk: int | None = None,
        **extra: Any,
    ) -> None:
        arg: Any = toks if as_array is None else np.array(toks, dtype=as_array)
        kw: dict[str, Any] = dict(extra)
        if chunk is not None:
            kw["num_new_tokens"] = chunk
        if salt is not None:
            kw["cache_salt"] = salt
        if lora is not None:
            kw["lora_id"] = lora
        if lookahead:
            kw["lookahead"] = lookahead
        if self.both("allocate", sid, arg, **kw).exc is None:
            self.remember(sid)

    @rule(
        data=st.data(),
        toks=tokens,
        salt=salts,
        lora=loras,
        lookahead=st.integers(0, 3),
        as_array=st.sampled_from([None, None, np.int64, np.uint32, np.int32]),
        chunked=st.booleans(),
    )
    def allocate(
        self,
        data: st.DataObject,
        toks: list[int],
        salt: Any,
        lora: Any,
        lookahead: int,
        as_array: Any,
        chunked: bool,
    ) -> None:
        # Chunked prefill: part of the prompt now (now and then 0 or past the prompt: refused).
        chunk = data.draw(st.integers(0, len(toks) + 1), label="chunk") if chunked else None
        # A hit cap and held registration, now and then, on self-hashed sequences too.
        extra = data.draw(
            st.sampled_from(
                [{}, {}, {}, {"max_hit_tokens": 2}, {"register": False}, {"max_hit_tokens": 0}]
            ),
            label="extra",
        )
        sid = self.pick(data, "new")
        self.do_allocate(sid, toks, salt, lora, lookahead, as_array, chunk, **extra)
        if "register" in extra and sid in self.ref:
            self.held.add(sid)

    def bs(self) -> int:
        return int(self.ref.block_size)

    @rule(
        data=st.data(),
        fresh=tokens,
        family=families,
        lookahead=st.integers(0, 2),
        cap=max_hits,
        register=st.sampled_from([True, True, True, False]),
        chunked=st.booleans(),
        short=short_by,
    )
    def allocate_keyed(
        self,
        data: st.DataObject,
        fresh: list[int],
        family: bytes,
        lookahead: int,
        cap: int | None,
        register: bool,
        chunked: bool,
        short: int,
    ) -> None:
        """A caller-keyed prompt (mostly an earlier prompt's prefix: equal keys hit), with
        fewer keys than full blocks now and then, or one too many (refused)."""
        toks, family = self.keyed_prompt(data, fresh, family)
        count = max(0, len(toks) // self.bs() - short)
        keys: Any = caller_keys(family, toks, self.bs(), 0, count)
        if data.draw(st.booleans(), label="tuple"):
            keys = tuple(keys)
        kw: dict[str, Any] = {"block_hashes": keys, "max_hit_tokens": cap, "register": register}
        if chunked:
            kw["num_new_tokens"] = data.draw(st.integers(1, len(toks)), label="chunk")
        if lookahead:
            kw["lookahead"] = lookahead
        if data.draw(st.integers(0, 19), label="salted") == 0:
            kw["cache_salt"] = "s"  # refused: the keys carry the extra keys
        sid = self.pick(data, "new")
        self.next_family = family
        try:
            out = self.both("allocate", sid, toks, **kw)
        finally:
            self.next_family = None
        if out.exc is None:
            self.families[sid] = family
            if not register:
                self.held.add(sid)
            if len(self.keyed_history) < 32:
                self.keyed_history.append((list(toks), family))

    def keyed_prompt(
        self, data: st.DataObject, fresh: list[int], family: bytes
    ) -> tuple[list[int], bytes]:
        """Mostly an earlier keyed prompt's prefix (plus a suffix), mostly in its family:
        equal keys hit; else a fresh prompt, or an earlier self-hashed one (no hit)."""
        how = data.draw(st.integers(0, 5), label="prompt")
        if self.keyed_history and how >= 2:
            toks, fam = data.draw(st.sampled_from(self.keyed_history), label="keyed prompt")
            cut = data.draw(st.integers(1, len(toks)), label="prefix length")
            return toks[:cut] + fresh[: data.draw(st.integers(0, 2))], (fam if how >= 3 else family)
        if self.history and how == 1:
            return self.earlier_prompt(data, [])[0], family
        return fresh, family

    def next_keys(self, data: st.DataObject, sid: int, toks_after: int, new: list[int]) -> Any:
        """Keys continuing a sequence's list up to its full blocks after `new` tokens (now
        and then one too many: refused), or None."""
        if sid not in self.ref or not data.draw(st.booleans(), label="keys"):
            return None
        have = self.ref.num_block_hashes(sid)
        upto = max(have, toks_after // self.bs() - data.draw(short_by, label="short"))
        all_toks = list(self.ref._seqs[sid].tokens) + new
        return caller_keys(self.families.get(sid, b"a"), all_toks, self.bs(), have, upto)

    @rule(data=st.data(), toks=st.lists(vocab, max_size=4), lookahead=st.integers(0, 3))
    def append_keyed(self, data: st.DataObject, toks: list[int], lookahead: int) -> None:
        """`append` with keys (keys arriving late, with or without tokens) or with empty
        tokens and lookahead (slots only); empty with neither is refused."""
        sid = self.pick(data, "resident")
        n = self.ref.num_tokens(sid) if sid in self.ref else 0
        keys = self.next_keys(data, sid, n + len(toks), toks)
        kw: dict[str, Any] = {"lookahead": lookahead}
        if keys is not None:
            kw["block_hashes"] = keys
        if self.both("append", sid, toks, **kw).exc is None:
            self.remember(sid)

    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        """Lift a hold (all, or up to some tokens: past the scheduled ones is refused), with
        further keys now and then."""
        held = sorted(s for s in self.held if s in self.ref)
        if held and data.draw(st.integers(0, 2), label="held"):
            sid = data.draw(st.sampled_from(held), label="held sid")
        else:
            sid = self.pick(data, "known")
        s = self.ref.num_scheduled_tokens(sid) if sid in self.ref else 4
        kw: dict[str, Any] = {}
        if data.draw(st.booleans(), label="num_tokens"):
            kw["num_tokens"] = data.draw(st.integers(0, s + 1), label="t")
        n = self.ref.num_tokens(sid) if sid in self.ref else 0
        keys = self.next_keys(data, sid, n, [])
        if keys is not None:
            kw["block_hashes"] = keys
        self.both("register", sid, **kw)

    @rule(data=st.data(), family=families, cap=max_hits, how=st.integers(0, 2))
    def lookup_keyed(self, data: st.DataObject, family: bytes, cap: int | None, how: int) -> None:
        """`lookup` and `can_allocate` (of token ids or of a length) with caller keys and a
        hit cap."""
        toks, family = self.keyed_prompt(data, data.draw(tokens), family)
        kw: dict[str, Any] = {"max_hit_tokens": cap}
        if data.draw(st.integers(0, 3), label="keyed"):
            count = max(0, len(toks) // self.bs() - data.draw(short_by, label="short"))
            kw["block_hashes"] = caller_keys(family, toks, self.bs(), 0, count)
        if how == 0:
            self.both("lookup", toks, **kw)
        elif how == 1:
            self.both("can_allocate", toks, **kw)
        else:
            self.both("can_allocate", len(toks), **kw)

    def earlier_prompt(self, data: st.DataObject, suffix: list[int]) -> tuple[list[int], Any, Any]:
        """A prompt that starts like an earlier one, mostly with the same extra keys."""
        toks, salt, lora = data.draw(st.sampled_from(self.history), label="earlier prompt")
        cut = data.draw(st.integers(1, len(toks)), label="prefix length")
        if data.draw(st.integers(0, 4), label="other extras") == 0:
            salt, lora = data.draw(salts), data.draw(loras)
        return toks[:cut] + suffix, salt, lora

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data(), suffix=st.lists(vocab, max_size=4), lookahead=st.integers(0, 2))
    def allocate_shared_prefix(
        self, data: st.DataObject, suffix: list[int], lookahead: int
    ) -> None:
        """A prompt that starts like an earlier one: prefix hits (cached or owned blocks)."""
        toks, salt, lora = self.earlier_prompt(data, suffix)
        chunk = None
        if data.draw(st.booleans(), label="chunked"):
            chunk = data.draw(st.integers(1, len(toks)), label="chunk")
        self.do_allocate(self.pick(data, "new"), toks, salt, lora, lookahead, None, chunk)

    def scheduled_left(self, sid: int) -> int:
        """Prompt tokens of a known sequence not yet scheduled (0 for an unknown one)."""
        if sid not in self.ref:
            return 0
        return self.ref.num_tokens(sid) - self.ref.num_scheduled_tokens(sid)

    @rule(data=st.data(), lookahead=st.integers(0, 3))
    def extend(self, data: st.DataObject, lookahead: int) -> None:
        """The next chunk of a prompt (now and then 0, or more than is left: refused)."""
        sid = self.pick(data, "partial")
        k = data.draw(st.integers(0, self.scheduled_left(sid) + 1), label="chunk")
        kw = {"lookahead": lookahead} if lookahead else {}
        self.both("extend", sid, k, **kw)

    @rule(data=st.data(), toks=short_tokens, lookahead=st.integers(0, 3))
    def append(self, data: st.DataObject, toks: list[int], lookahead: int) -> None:
        sid = self.pick(data, "resident")
        kw = {"lookahead": lookahead} if lookahead else {}
        if self.both("append", sid, toks, **kw).exc is None:
            self.remember(sid)

    @rule(data=st.data(), lookahead=st.integers(0, 2))
    def append_batch(self, data: st.DataObject, lookahead: int) -> None:
        # Repeated, unknown and swapped ids at once, sometimes: docs/inputs.md fixes the order.
        ids = self.picks(data, "resident", unique=data.draw(st.integers(0, 3)) > 0)
        toks = data.draw(st.lists(vocab, min_size=len(ids), max_size=len(ids)))
        kw = {"lookahead": lookahead} if lookahead else {}
        self.both(
            "append_batch", np.array(ids, dtype=np.int64), np.array(toks, dtype=np.int64), **kw
        )

    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Roll back rejected drafts (now and then to 0 or past the end: refused)."""
        sid = self.pick(data, "resident")
        n = self.ref.num_tokens(sid) if sid in self.ref else 4
        self.both("truncate", sid, data.draw(st.integers(0, n + 1), label="keep"))

    @rule(data=st.data(), free_child=st.booleans())
    def rollback_shared(self, data: st.DataObject, free_child: bool) -> None:
        """Fork, then roll the parent back into its last block (which the child still holds
        hashed), then maybe free the child: the parent's next write copies that block even
        when it holds it alone."""
        parent, child = self.pick(data, "resident"), self.pick(data, "new")
        if self.both("fork", parent, child).exc is None:
            self.both("truncate", parent, max(1, self.ref.num_tokens(parent) - 1))
            if free_child:
                self.both("free", child)

    @rule(
        data=st.data(),
        toks=st.lists(vocab, min_size=2, max_size=8),
        child_truncates=st.booleans(),
        upto=st.booleans(),
        token=vocab,
    )
    def held_fork_truncate(
        self, data: st.DataObject, toks: list[int], child_truncates: bool, upto: bool, token: int
    ) -> None:
        """Held registration, fork and truncate (issue 32, item 1): one of two sharers of a
        held prompt truncates into a block that the other then registers full; once the
        other is freed, the truncated one writes there, and the prompt is allocated again.
        The oracles check that the hit serves the prompt's own KV."""
        a = self.pick(data, "new")
        if self.both("allocate", a, toks, register=False).raw is None:
            return
        self.held.add(a)
        b = self.pick(data, "new")
        if self.both("fork", a, b).exc is not None:
            return
        self.held.add(b)
        short, full = (b, a) if child_truncates else (a, b)
        keep = data.draw(st.integers(1, len(toks) - 1), label="keep")
        if self.both("truncate", short, keep).raw is None:
            return
        kw = {"num_tokens": len(toks)} if upto else {}
        self.both("register", full, **kw)
        self.both("free", full)
        self.both("append", short, [token])
        self.do_allocate(self.pick(data, "new"), toks, None, None, 0, None)

    @rule(data=st.data(), suffix=st.lists(vocab, max_size=3), how=st.integers(0, 3))
    def lookup(self, data: st.DataObject, suffix: list[int], how: int) -> None:
        """`lookup`, `lookup_many` and hit-aware `can_allocate` of earlier or fresh prompts."""
        if self.history and how:
            toks, salt, lora = self.earlier_prompt(data, suffix)
        else:
            toks, salt, lora = data.draw(tokens), data.draw(salts), data.draw(loras)
        kw: dict[str, Any] = {}
        if salt is not None:
            kw["cache_salt"] = salt
        if lora is not None:
            kw["lora_id"] = lora
        if how == 0:
            self.both("lookup_many", [toks, toks[:1], toks + suffix], **kw)
        elif how == 1:
            self.both("lookup", np.array(toks, dtype=np.uint32), **kw)
        else:
            if data.draw(st.booleans(), label="num_new_tokens"):
                kw["num_new_tokens"] = data.draw(st.integers(0, len(toks) + 1), label="k")
            self.both("can_allocate", toks, **kw)

    @rule(data=st.data(), how=st.integers(0, 5))
    def evict_blocks(self, data: st.DataObject, how: int) -> None:
        """`evict_blocks` (vLLM's, after a failed KV load) of cached blocks, blocks that
        sequences hold and blocks in no cache; now and then an id past the pool, or the ids
        in another accepted or a refused form (the same exception class from both)."""
        ref = self.ref
        n = ref.num_blocks
        held = [
            b
            for s in range(MAX_SEQ)
            if s in ref and not ref.is_swapped(s)
            for b in ref.block_table(s)
        ]
        known = held + ref._cached_blocks() + list(range(n))  # the reference's own records
        ids = data.draw(st.lists(st.sampled_from(known), max_size=4), label="block ids")
        if how == 0:
            ids.append(data.draw(st.sampled_from([n, -1, 2**31, 2**40]), label="bad id"))
            self.both("evict_blocks", ids)
        elif how == 1:
            form = data.draw(st.sampled_from(REFUSED), label="refused form")
            self.both_with("evict_blocks", lambda: (form(ids),))
        elif how == 2:
            odd = data.draw(st.sampled_from(ODD_IDS), label="id form")
            self.both_with("evict_blocks", lambda: (odd(ids),) if ids else ([],))
        else:
            self.both("evict_blocks", ids)

    @rule(
        data=st.data(),
        suffix=st.lists(vocab, max_size=3),
        which=st.sampled_from(["allocation_cost", "lookup_blocks"]),
    )
    def cost_and_blocks(self, data: st.DataObject, suffix: list[int], which: str) -> None:
        """`allocation_cost` and `lookup_blocks` of earlier or fresh prompts (or a length),
        with `max_hit_tokens` now and then; then, sometimes, `allocate` of that prompt,
        which must take exactly the hit and blocks the cost said."""
        if self.history and data.draw(st.booleans(), label="earlier"):
            toks, salt, lora = self.earlier_prompt(data, suffix)
        else:
            toks, salt, lora = data.draw(tokens), data.draw(salts), data.draw(loras)
        kw: dict[str, Any] = {}
        if salt is not None:
            kw["cache_salt"] = salt
        if lora is not None:
            kw["lora_id"] = lora
        if data.draw(st.integers(0, 3), label="max_hit") == 0:
            kw["max_hit_tokens"] = data.draw(st.integers(-1, 9), label="max_hit_tokens")
        if which == "lookup_blocks":
            self.both("lookup_blocks", toks, **kw)
            return
        if data.draw(st.booleans(), label="num_new_tokens"):
            kw["num_new_tokens"] = data.draw(st.integers(0, len(toks) + 1), label="k")
        if data.draw(st.booleans(), label="lookahead"):
            kw["lookahead"] = data.draw(st.integers(-1, 3), label="lookahead")
        arg: Any = toks
        if data.draw(st.integers(0, 4), label="a length") == 0:
            arg = data.draw(st.integers(0, 30), label="num_tokens")
        if self.both("allocation_cost", arg, **kw).exc is not None:
            return
        if arg is toks and "max_hit_tokens" not in kw and data.draw(st.booleans()):
            hit, new, revived = self.ref.allocation_cost(toks, **kw)
            before = self.ref.num_available_blocks
            sid = self.pick(data, "new")
            got = self.both("allocate", sid, toks, **kw)
            if got.exc is None and got.value is not None:
                assert got.value == ("int", hit)
                assert before - self.ref.num_available_blocks == new + revived
                self.remember(sid)

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent, child = self.pick(data, "resident"), self.pick(data, "new")
        self.both("fork", parent, child)

    @rule(data=st.data(), computed=st.booleans())
    def free(self, data: st.DataObject, computed: bool) -> None:
        sid = self.pick(data, "known")
        if computed:
            # An engine whose last steps never ran: retraction (now and then -1 or past the
            # tokens: refused).
            n = self.ref.num_tokens(sid) if sid in self.ref else 4
            c = data.draw(st.integers(-1, n + 1), label="num_computed_tokens")
            self.both("free", sid, num_computed_tokens=c)
        else:
            self.both("free", sid)

    @rule(data=st.data())
    def free_batch(self, data: st.DataObject) -> None:
        self.both("free_batch", self.picks(data, "known", unique=data.draw(st.booleans())))

    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self.both("swap_out", self.pick(data, "resident"))

    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self.both("swap_in", self.pick(data, "swapped"))

    @rule(data=st.data(), n=st.integers(0, 100))
    def can_allocate_or_swap_in(self, data: st.DataObject, n: int) -> None:
        if data.draw(st.booleans(), label="can_swap_in"):
            self.both("can_swap_in", self.pick(data, "swapped"))
        elif data.draw(st.booleans(), label="num_new_tokens"):
            self.both("can_allocate", n, num_new_tokens=data.draw(st.integers(0, n + 1)))
        else:
            self.both("can_allocate", n)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.both("reset_prefix_cache")

    @rule(capacity=st.sampled_from([None, 1, 2, 3, 8, 0, -1]))
    def set_kv_event_capacity(self, capacity: int | None) -> None:
        """A small bound overflows within one step (the invariant drains after each)."""
        self.both("set_kv_event_capacity", capacity)

    @rule()
    def kv_event_snapshot(self) -> None:
        self.both("kv_event_snapshot")

    @rule(
        data=st.data(),
        which=st.sampled_from(["block_tables", "slot_mapping", "flashinfer_page_table"]),
    )
    def batch_query(self, data: st.DataObject, which: str) -> None:
        ids = self.picks(data, "resident", unique=False)
        if which == "block_tables":
            pad = data.draw(st.sampled_from([-1, 0, 7]), label="pad")
            self.both("block_tables", ids, pad=pad)
        elif which == "flashinfer_page_table":
            kw = self.draw_lookahead(data, len(ids))
            self.both("flashinfer_page_table", np.array(ids, dtype=np.int64), **kw)
        else:
            k: Any
            if data.draw(st.booleans(), label="one count"):
                k = data.draw(st.integers(0, 4), label="num_new_tokens")
            else:
                ks = data.draw(st.lists(st.integers(0, 6), min_size=len(ids), max_size=len(ids)))
                k = np.array(ks, dtype=np.int64)
            self.both("slot_mapping", ids, k, **self.draw_lookahead(data, len(ids)))

    def draw_lookahead(self, data: st.DataObject, n: int) -> dict[str, Any]:
        """A batch query's draft slots: none, one int for all, or one per sequence (a mixed
        batch: 0 for some) as a list, tuple or array; past a table's room now and then, and
        now and then of the wrong length or with a negative entry (refused)."""
        how = data.draw(st.sampled_from(["none", "int", "each", "each", "bad"]), label="la")
        if how == "none":
            return {}
        if how == "int":
            return {"lookahead": data.draw(st.sampled_from([0, 1, 2, 3, 5]), label="lookahead")}
        las = data.draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 5]), min_size=n, max_size=n))
        if how == "bad":
            if las and data.draw(st.booleans(), label="negative"):
                las[data.draw(st.integers(0, n - 1), label="at")] = -1
            else:
                las = [*las, 0] if data.draw(st.booleans(), label="longer") else las[:-1]
        form = data.draw(st.sampled_from([list, tuple, "<i8", ">i4", "i1"]), label="form")
        arg: Any = form(las) if callable(form) else np.array(las, dtype=form)
        return {"lookahead": arg}

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "allocate empty",
                "allocate negative token",
                "allocate token 2**32",
                "allocate lookahead -1",
                "allocate num_new_tokens",
                "append lookahead",
                "extend faults",
                "truncate faults",
                "free faults",
                "lookup faults",
                "append empty",
                "keys faults",
                "negative id",
                "batch duplicates",
                "query",
            ]
        ),
    )
    def invalid_call(self, data: st.DataObject, kind: str) -> None:
        """Calls with one thing wrong (the rules above also make unknown, duplicate and
        swapped ids), and per-sequence queries on any id."""
        if kind == "allocate empty":
            self.both("allocate", self.pick(data, "new"), [])
        elif kind == "allocate negative token":
            self.both("allocate", self.pick(data, "new"), [0, -1])
        elif kind == "allocate token 2**32":
            self.both("allocate", self.pick(data, "new"), np.array([2**32]))
        elif kind == "allocate lookahead -1":
            self.both("allocate", self.pick(data, "new"), [0], lookahead=-1)
        elif kind == "allocate num_new_tokens":
            # Several faults at once, sometimes: each argument's kind before the fit.
            bad = data.draw(st.sampled_from([0, -1, 3, 1.5, True, "1"]), label="k")
            la = data.draw(st.sampled_from([0, -1, 1.5]), label="lookahead")
            self.both(
                "allocate", self.pick(data, "known"), [0, 1], num_new_tokens=bad, lookahead=la
            )
        elif kind == "append lookahead":
            la = data.draw(st.sampled_from([-1, 1.5, None]), label="lookahead")
            self.both("append", self.pick(data, "known"), [0], lookahead=la)
        elif kind == "extend faults":
            k = data.draw(st.sampled_from([0, -1, 1, 1.5, 100]), label="k")
            la = data.draw(st.sampled_from([0, -1, 1.5]), label="lookahead")
            self.both("extend", self.pick(data, "known"), k, lookahead=la)
        elif kind == "truncate faults":
            m = data.draw(st.sampled_from([0, -1, 1, 1.5, 100, None]), label="num_tokens")
            self.both("truncate", self.pick(data, "known"), m)
        elif kind == "free faults":
            c = data.draw(st.sampled_from([-1, 1.5, 100, 2**64]), label="num_computed_tokens")
            self.both("free", self.pick(data, "known"), num_computed_tokens=c)
        elif kind == "lookup faults":
            which = data.draw(st.sampled_from(["lookup", "lookup_many", "can_allocate"]))
            arg = data.draw(st.sampled_from([[], [-1], [1.5], iter([1]), [[1], []]]))
            if which == "lookup_many" and not (isinstance(arg, list) and arg and arg[0] == [1]):
                arg = [arg]
            self.both(which, arg, lora_id=data.draw(st.sampled_from([None, -1, 1.5])))
        elif kind == "append empty":
            self.both("append", self.pick(data, "resident"), [])
        elif kind == "keys faults":
            # Each argument's kind (and a key's length) before the cross-argument checks.
            keys = data.draw(
                st.sampled_from(
                    [None, [b"k"], b"ab", "ab", [b""], [b"x" * 129], [1], [bytearray(b"a")]]
                ),
                label="block_hashes",
            )
            cap = data.draw(st.sampled_from([None, -1, 1.5, 2]), label="max_hit_tokens")
            reg = data.draw(st.sampled_from([True, None, 1]), label="register")
            which = data.draw(st.sampled_from(["allocate", "lookup", "append", "register"]))
            if which == "allocate":
                self.both(
                    "allocate",
                    self.pick(data, "new"),
                    [0, 1, 2],
                    block_hashes=keys,
                    max_hit_tokens=cap,
                    register=reg,
                )
            elif which == "lookup":
                self.both("lookup", [0, 1, 2], block_hashes=keys, max_hit_tokens=cap)
            elif which == "append":
                self.both("append", self.pick(data, "resident"), [], block_hashes=keys)
            else:
                t = data.draw(st.sampled_from([None, -1, 1.5]), label="num_tokens")
                self.both("register", self.pick(data, "known"), num_tokens=t, block_hashes=keys)
        elif kind == "negative id":
            method = data.draw(
                st.sampled_from(["free", "swap_out", "swap_in", "num_tokens", "block_table"])
            )
            self.both(method, -1)
        elif kind == "batch duplicates":
            sid = self.pick(data, "resident")
            if data.draw(st.booleans(), label="append_batch"):
                self.both("append_batch", [sid, sid], [0, 1])
            else:
                self.both("free_batch", [sid, sid])
        else:
            sid = self.pick(data, "known")
            for method in ("block_table", "num_tokens", "block_hashes", "is_swapped"):
                self.both(method, sid)

    @rule(
        data=st.data(),
        method=st.sampled_from(
            [
                "allocate",
                "append",
                "append_batch",
                "free_batch",
                "block_tables",
                "slot_mapping",
                "lookup",
                "can_allocate",
            ]
        ),
        refused=st.booleans(),
    )
    def other_forms(self, data: st.DataObject, method: str, refused: bool) -> None:
        """The same calls with ids and tokens as tuples, ranges, arrays of other dtypes and
        byte orders (accepted), or as generators, sets, buffers, float or bool arrays, masked
        or 0-d arrays (refused: the same exception class from both)."""
        forms = REFUSED if refused else None
        tok_form = data.draw(st.sampled_from(forms or ODD_TOKENS), label="token form")
        id_form = data.draw(st.sampled_from(forms or ODD_IDS), label="id form")
        # A refused form is built afresh for each manager (a generator is used up).
        if method == "allocate":
            sid, toks = self.pick(data, "new"), data.draw(tokens)
            if self.both_with(method, lambda: (sid, tok_form(toks))):
                self.remember(sid)
        elif method == "append":
            sid, toks = self.pick(data, "resident"), data.draw(short_tokens)
            self.both_with(method, lambda: (sid, tok_form(toks)))
        elif method in ("lookup", "can_allocate"):
            toks = data.draw(tokens)
            self.both_with(method, lambda: (tok_form(toks),))
        elif method == "append_batch":
            ids = self.picks(data, "resident")
            toks = data.draw(st.lists(vocab, min_size=len(ids), max_size=len(ids)))
            self.both_with(method, lambda: (id_form(ids), tok_form(toks)))
        elif method == "free_batch":
            ids = self.picks(data, "known")
            self.both_with(method, lambda: (id_form(ids),))
        elif method == "block_tables":
            ids = self.picks(data, "resident", unique=False)
            self.both_with(method, lambda: (id_form(ids),))
        else:
            ids = self.picks(data, "resident")
            ks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
            self.both_with(method, lambda: (id_form(ids), tok_form(ks)))

    def both_with(self, method: str, make_args: Callable[[], tuple[Any, ...]]) -> bool:
        """`both`, with arguments made afresh for each manager; True if the call succeeded."""
        args = make_args()
        self.log.append(f"{method}{args!r}")
        rust_args = make_args()
        self.ref_kv.before(self.ref, method, args, {})
        self.rust_kv.before(self.rust, method, rust_args, {})
        want = run(self.ref, method, *args)
        got = run(self.rust, method, *rust_args)
        for kv, m, a, out in (
            (self.ref_kv, self.ref, args, want),
            (self.rust_kv, self.rust, rust_args, got),
        ):
            kv.after(m, method, a, {}, out.raw, out.exc)
        if want.exc is not None:
            assert isinstance(want.exc, PagedKVError), f"reference raised {want.exc!r}"
        assert got.key() == want.key(), (
            f"{method}{args!r}: rust {got.describe()}, reference {want.describe()}"
            "\n  after: " + "\n  ".join(self.log)
        )
        return want.exc is None

    # ---------------------------------------------------------------- after every step

    @invariant()
    def same_observable_state(self) -> None:
        if not hasattr(self, "ref"):
            return
        ref, rust = self.ref, self.rust
        where = "\n  after: " + "\n  ".join(self.log)
        assert len(rust) == len(ref), where
        for prop in (
            "num_free_blocks",
            "num_cached_blocks",
            "num_available_blocks",
            "num_free_cpu_blocks",
            "num_blocks",
            "block_size",
        ):
            assert getattr(rust, prop) == getattr(ref, prop), prop + where
        assert _stats(rust) == _stats(ref), where
        assert run(rust, "kv_event_queue_stats").key() == run(ref, "kv_event_queue_stats").key()
        drained = run(rust, "drain_events"), run(ref, "drain_events")
        assert drained[0].key() == drained[1].key(), where  # events, or both overflowed
        for impl in (ref, rust):
            tables: dict[tuple[int, ...], int] = {}
            for s in range(MAX_SEQ):
                if s not in impl or impl.is_swapped(s):
                    continue
                digest = impl.table_digest(s)
                assert isinstance(digest, int) and 0 <= digest < 2**64
                table = tuple(impl.block_table(s))
                assert tables.setdefault(table, digest) == digest, (
                    f"{type(impl).__name__}: equal tables {table}, different digests" + where
                )
        for s in range(MAX_SEQ):
            assert (s in rust) == (s in ref), f"{s} in manager" + where
            if s not in ref:
                continue
            for method in (
                "num_tokens",
                "num_scheduled_tokens",
                "is_swapped",
                "block_hashes",
                "num_block_hashes",
                "block_table",
            ):
                want = run(ref, method, s).key()
                assert run(rust, method, s).key() == want, f"{method}({s})" + where
            # Digest values differ between implementations; whether the call raises may not.
            want_exc = run(ref, "table_digest", s).exc
            got_exc = run(rust, "table_digest", s).exc
            assert type(got_exc) is type(want_exc), f"table_digest({s})" + where
        ref.check_invariants()
        rust.check_invariants()


ManagerComparison.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerComparison = ManagerComparison.TestCase
