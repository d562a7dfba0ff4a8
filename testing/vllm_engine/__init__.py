"""Support for running pagedkv inside a real vLLM engine on the CPU (tests/engine, the
engine benchmark): a tiny Llama of seeded random weights whose outputs depend on the KV
cache, and the scenarios run on a stock and a pagedkv engine side by side."""
