"""Built-in model shapes, the KV-cache groups vLLM forms for them, and what a block weighs.

One table (`MODELS`) of model shapes: each layer's kind, KV heads, head dimension, dtype and,
for recurrent-state layers, the bytes of one layer's state. From a shape and a block size,
`model_layout` forms the groups as vLLM does (`vllm/v1/core/kv_cache_utils.py`, see
`shared/notes/hybrid-groups.md` section 1) and `full_layout` makes the all-full equivalent
(every layer full attention, one group). A `Layout` says what one pool block weighs in bytes,
so that block counts turn into GiB (`bytes_per_block`, `gib`) anywhere in the simulator.

vLLM's rules, as followed here:

- layers are bucketed by kind (a sliding window of 1024 and one of 128 are two kinds), the
  buckets in the order their first layer appears;
- group size = the smallest bucket's layer count, or the largest when largest < 1.5 x smallest;
- each bucket of `n` layers splits into `ceil(n / size)` groups, strided (`layers[i::k]`); a
  group with fewer layers than `size` is padded: every pool block holds `size` layer pages;
- one page size for all groups: attention layers share one shape here, and a model with
  state layers raises the attention block size to `16 * ceil(state / (16 * attn_per_token))`
  tokens (at least the block size asked for), so that one attention page holds one state;
  the state page is padded to the attention page (`vllm/model_executor/models/config.py`).

Memory: a pool block is `group_size` layer pages of `block_size` tokens, one page being
`2 * kv_heads * head_dim * dtype_bytes * block_size` bytes (K and V); a state page is padded
to that size. `num_blocks = budget_bytes // bytes_per_block` (vLLM: memory // page //
group_size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.groups import KVCacheGroup

GIB = 1 << 30
BF16 = 2  # bytes per element
# vLLM's kernel block alignment when it raises the attention block for state models.
STATE_BLOCK_ALIGN = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


FULL = KVCacheGroup("full")
STATE = KVCacheGroup("state")


def _sliding(window: int) -> KVCacheGroup:
    return KVCacheGroup("sliding_window", window=window)


def _chunked(chunk: int) -> KVCacheGroup:
    return KVCacheGroup("chunked_local", chunk=chunk)


def _every(num_layers: int, period: int, local: KVCacheGroup) -> tuple[KVCacheGroup, ...]:
    """`period - 1` local layers then one full-attention layer, repeated (layer i is full
    when (i + 1) % period == 0), the pattern of Gemma 3, Llama 4 and Qwen3-Next."""
    return tuple(FULL if (i + 1) % period == 0 else local for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the KV cache of a model needs: one layer spec per layer (a `KVCacheGroup` with
    `num_layers=1`), the attention layers' KV heads and head dimension, the dtype size and,
    for state layers, the bytes of one layer's recurrent state."""

    name: str
    layers: tuple[KVCacheGroup, ...]
    kv_heads: int
    head_dim: int
    dtype_bytes: int = BF16
    state_bytes: int = 0  # one state layer's state (conv + SSM), bytes
    source: str = field(default="", compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one attention layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def full_kv_bytes_per_token(self) -> int:
        """KV bytes per token of the all-full equivalent: every layer full attention."""
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def layer_counts(self) -> dict[KVCacheGroup, int]:
        """Layers of each kind, in the order the kinds first appear."""
        counts: dict[KVCacheGroup, int] = {}
        for spec in self.layers:
            counts[spec] = counts.get(spec, 0) + 1
        return counts

    def describe(self) -> str:
        kinds = " + ".join(f"{n} {describe_kind(k)}" for k, n in self.layer_counts().items())
        out = (
            f"{self.name}: {self.num_layers} layers ({kinds}); attention "
            f"{self.kv_heads} KV heads x {self.head_dim}, {self.dtype_bytes} bytes per element"
        )
        if self.state_bytes:
            out += f"; state {self.state_bytes} bytes per layer"
        return out


def describe_kind(g: KVCacheGroup) -> str:
    """`full`, `sliding_window(1024)`, `chunked_local(8192)` or `state`."""
    if g.window is not None:
        return f"{g.kind}({g.window})"
    if g.chunk is not None:
        return f"{g.kind}({g.chunk})"
    return g.kind


# Qwen3-Next linear-attention (Gated DeltaNet) state per layer, bf16, tensor parallel 1
# (shared/notes/hybrid-groups.md section 5; config: 16 key heads, 32 value heads, head dims
# 128, conv kernel 4; the shapes follow vLLM's mamba_utils formula, no model card states
# them): conv state (kernel - 1, 2 * 16 * 128 + 32 * 128) = (3, 8192), SSM state
# (32 value heads, 128, 128). 3 * 8192 * 2 + 32 * 128 * 128 * 2 = 1,097,728 bytes (~1.1 MB;
# ~2.1 MB if the SSM state is kept in fp32, as some deployments do).
QWEN3_NEXT_STATE_BYTES = (3 * 8192 + 32 * 128 * 128) * BF16

MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        # meta-llama/Meta-Llama-3-8B config.json (read from mirrors; the gated original was
        # not): 32 layers, num_key_value_heads 8, head_dim 128 (4096 / 32 heads), bf16.
        ModelShape(
            "llama-3-8b",
            (FULL,) * 32,
            kv_heads=8,
            head_dim=128,
            source="meta-llama/Meta-Llama-3-8B config.json (mirrors)",
        ),
        # google/gemma_pytorch gemma/config.py (Gemma 3 12B): 48 layers, 8 KV heads x 256,
        # sliding window 1024, pattern 5 local : 1 global -> 40 SW + 8 full.
        ModelShape(
            "gemma-3-12b",
            _every(48, 6, _sliding(1024)),
            kv_heads=8,
            head_dim=256,
            source="google/gemma_pytorch gemma/config.py",
        ),
        # Same file (Gemma 3 27B): 62 layers, 16 KV heads x 128, window 1024, 5:1 -> 52 SW +
        # 10 full (the 52/10 split is also in vLLM's hybrid KV cache manager design doc).
        ModelShape(
            "gemma-3-27b",
            _every(62, 6, _sliding(1024)),
            kv_heads=16,
            head_dim=128,
            source="google/gemma_pytorch gemma/config.py; vLLM docs/design",
        ),
        # openai/gpt-oss gpt_oss/torch/model.py: 24 layers alternating sliding window 128
        # (even layers) and full attention, 8 KV heads x 64; KV cache in bf16.
        ModelShape(
            "gpt-oss-20b",
            tuple(_sliding(128) if i % 2 == 0 else FULL for i in range(24)),
            kv_heads=8,
            head_dim=64,
            source="openai/gpt-oss gpt_oss/torch/model.py; NVIDIA Megatron-Bridge docs",
        ),
        # Same, 36 layers (18 SW + 18 full).
        ModelShape(
            "gpt-oss-120b",
            tuple(_sliding(128) if i % 2 == 0 else FULL for i in range(36)),
            kv_heads=8,
            head_dim=64,
            source="openai/gpt-oss gpt_oss/torch/model.py; NVIDIA Megatron-Bridge docs",
        ),
        # huggingface/transformers configuration_llama4.py (Llama-4-Scout-17B-16E): 48
        # layers, attention_chunk_size 8192, every 4th layer global (no RoPE) -> 36 chunked
        # + 12 full, 8 KV heads x 128, bf16.
        ModelShape(
            "llama-4-scout",
            _every(48, 4, _chunked(8192)),
            kv_heads=8,
            head_dim=128,
            source="huggingface/transformers configuration_llama4.py (Scout-17B-16E)",
        ),
        # huggingface/transformers configuration_qwen3_next.py: 48 layers, full_attention_
        # interval 4 -> 36 Gated DeltaNet (state) + 12 full; attention 2 KV heads x 256.
        ModelShape(
            "qwen3-next-80b-a3b",
            _every(48, 4, STATE),
            kv_heads=2,
            head_dim=256,
            state_bytes=QWEN3_NEXT_STATE_BYTES,
            source="huggingface/transformers configuration_qwen3_next.py; vLLM mamba_utils",
        ),
    )
}


def get_model(name: str) -> ModelShape:
    """The preset called `name`; ValueError listing the presets otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}") from None


@dataclass(frozen=True, slots=True)
class Layout:
    """A model's KV cache as one pool: its groups, block size and bytes per block."""

    model: ModelShape
    block_size: int  # tokens per block (raised for state models)
    group_size: int  # layer pages per pool block: the largest group, padding included
    groups: tuple[KVCacheGroup, ...]  # with num_layers = the group's real layers
    layer_ids: tuple[tuple[int, ...], ...]  # the model layers of each group
    page_bytes: int  # one layer's page: block_size tokens of K and V (a state padded to it)

    @property
    def bytes_per_block(self) -> int:
        """What one pool block weighs: `group_size` layer pages."""
        return self.group_size * self.page_bytes

    @property
    def padding_layers(self) -> int:
        """Layer pages per block that no layer uses (vLLM warns about them)."""
        return len(self.groups) * self.group_size - self.model.num_layers

    @property
    def manager_groups(self) -> tuple[KVCacheGroup, ...] | None:
        """The `groups=` for the block manager: None for one full-attention group, which is
        exactly the manager without groups (no null block, the same hits)."""
        if len(self.groups) == 1 and self.groups[0].kind == "full":
            return None
        return self.groups

    def num_blocks(self, budget_bytes: int) -> int:
        """Pool blocks that fit in `budget_bytes` (the null block included, as in vLLM)."""
        return budget_bytes // self.bytes_per_block

    def gib(self, blocks: float) -> float:
        """GiB of `blocks` pool blocks."""
        return blocks * self.bytes_per_block / GIB

    def describe(self) -> str:
        pad = f" ({self.padding_layers} padding)" if self.padding_layers else ""
        n = len(self.groups)
        return (
            f"{n} group{'s' if n > 1 else ''} of {self.group_size} layers{pad}; block "
            f"{self.block_size} tokens; page {self.page_bytes} bytes per layer, "
            f"{self.bytes_per_block} bytes per block"
        )


def group_size(counts: list[int]) -> int:
    """vLLM's layers per group for buckets of these layer counts."""
    smallest, largest = min(counts), max(counts)
    # When the buckets are nearly equal (gpt-oss-20b + an EAGLE layer: 12 SW + 13 full) the
    # largest avoids splitting one of them in two half-empty groups.
    return largest if largest < smallest * 1.5 else smallest


def attention_block_size(model: ModelShape, block_size: int) -> int:
    """The block size: as asked, or raised so that one attention page holds one state."""
    if not model.state_bytes:
        return block_size
    per_token = model.kv_bytes_per_token_per_layer
    raised = STATE_BLOCK_ALIGN * _cdiv(model.state_bytes, STATE_BLOCK_ALIGN * per_token)
    return max(block_size, raised)


def _check(model: ModelShape, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for spec in model.layer_counts():
        if spec.kind == "sliding_window" and spec.window is not None and spec.window < block_size:
            raise ValueError(
                f"{model.name}: window {spec.window} is smaller than a block of {block_size} tokens"
            )
        if spec.kind == "chunked_local" and spec.chunk is not None and spec.chunk % block_size:
            raise ValueError(
                f"{model.name}: chunk {spec.chunk} is not a multiple of the block size {block_size}"
            )
    if all(spec.kind == "state" for spec in model.layers):
        raise ValueError(f"{model.name}: no attention layer sets the page size")


def model_layout(model: ModelShape, block_size: int = 16) -> Layout:
    """The groups vLLM forms for `model` at `block_size` (raised for state models)."""
    bs = attention_block_size(model, block_size)
    _check(model, bs)
    buckets: dict[KVCacheGroup, list[int]] = {}
    for i, spec in enumerate(model.layers):
        buckets.setdefault(spec, []).append(i)
    size = group_size([len(ids) for ids in buckets.values()])
    groups: list[KVCacheGroup] = []
    layer_ids: list[tuple[int, ...]] = []
    for spec, ids in buckets.items():
        k = _cdiv(len(ids), size)
        for j in range(k):
            strided = tuple(ids[j::k])
            layer_ids.append(strided)
            groups.append(
                KVCacheGroup(
                    spec.kind,
                    window=spec.window,
                    chunk=spec.chunk,
                    block_size=bs,
                    num_layers=len(strided),
                )
            )
    page = bs * model.kv_bytes_per_token_per_layer
    assert page >= model.state_bytes  # attention_block_size saw to it
    return Layout(model, bs, size, tuple(groups), tuple(layer_ids), page)


def full_layout(model: ModelShape, block_size: int = 16) -> Layout:
    """The all-full equivalent: every layer full attention, in one group, at `block_size`
    (state layers become attention layers of the model's attention shape)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = model.num_layers
    group = KVCacheGroup("full", block_size=block_size, num_layers=n)
    page = block_size * model.kv_bytes_per_token_per_layer
    return Layout(model, block_size, n, (group,), (tuple(range(n)),), page)


def bytes_per_block(model: ModelShape, block_size: int = 16) -> int:
    """Bytes of one pool block of the model's own layout (vLLM's groups)."""
    return model_layout(model, block_size).bytes_per_block


def full_bytes_per_block(model: ModelShape, block_size: int = 16) -> int:
    """Bytes of one block of the all-full equivalent: `full_kv_bytes_per_token * block_size`."""
    return full_layout(model, block_size).bytes_per_block


__all__ = [
    "GIB",
    "MODELS",
    "Layout",
    "ModelShape",
    "attention_block_size",
    "bytes_per_block",
    "describe_kind",
    "full_bytes_per_block",
    "full_layout",
    "get_model",
    "group_size",
    "model_layout",
]
