"""A tiny Llama written locally: `config.json` + `model.safetensors` of seeded random weights.

vLLM loads it with `load_format="auto"` like any checkpoint. The weights are normal with
std 0.2 rather than vLLM's `load_format="dummy"` (uniform in +-1e-3): with dummy weights
attention contributes almost nothing, each output token depends only on the previous one,
and a wrong KV block could not change the output. With std 0.2 it does (the control test,
tests/engine/test_model_depends_on_kv.py, changes a prompt's first block and sees the
outputs change).

Shapes fit vLLM's CPU attention backend: head size 32 (it takes 32, 64, 80, ...), and the
engine's block size must be a multiple of 32. `sliding_window` gives a hybrid layout
(vLLM forms a full-attention and a sliding-window KV-cache group from `layer_types`).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32
LAYERS = 2
INTERMEDIATE = 256
STD = 0.2
# Token ids the tests may use in prompts: 1 is bos, 2 eos; prompts draw from [3, VOCAB).
FIRST_PROMPT_TOKEN = 3


def _config(layers: int, sliding_window: int | None) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if sliding_window is not None:
        # Odd layers slide, even layers see everything: two KV-cache groups in vLLM.
        config["sliding_window"] = sliding_window
        config["layer_types"] = [
            "sliding_attention" if i % 2 else "full_attention" for i in range(layers)
        ]
    return config


def write(
    directory: Path,
    *,
    seed: int = 0,
    layers: int = LAYERS,
    sliding_window: int | None = None,
) -> Path:
    """Write the model into `directory` (created) and return it. Same seed, same weights."""
    import torch
    from safetensors.torch import save_file

    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * STD

    kv = KV_HEADS * HEAD_DIM
    tensors = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            p + "self_attn.q_proj.weight": normal(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": normal(kv, HIDDEN),
            p + "self_attn.v_proj.weight": normal(kv, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(_config(layers, sliding_window), indent=1))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2})
    )
    return directory


__all__ = ["FIRST_PROMPT_TOKEN", "VOCAB", "write"]
