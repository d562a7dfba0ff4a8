"""Run vLLM's own scheduler tests on a CPU-only machine, offline, with a swappable KV manager.

`fetch` takes the tests from vLLM's source distribution and writes a fake Hugging Face cache;
`run` runs them in a pytest subprocess with `swap_manager` loaded as a plugin. docs/vllm.md
says how to run it by hand.
"""
