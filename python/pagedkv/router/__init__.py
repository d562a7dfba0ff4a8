"""An exact KV-aware router index: which engine holds which KV blocks (docs/router.md).

`RouterIndex` keeps, for many engines at once, the blocks each holds per medium and group,
fed by their KV events in vLLM's wire format (`apply`, or `follow` a live ZMQ stream), and
answers for a request's block hashes (or token ids) each engine's longest cached prefix,
ranked. The index is Rust (`pagedkv._core.RouterIndex`, the `pagedkv-router` crate).

`import pagedkv.router` needs numpy only; `follow` needs pyzmq and msgspec (the `events`
extra), imported when first called. `import pagedkv` does not import this package.
"""

from pagedkv.router.index import Applied, EngineId, EngineMatch, RouterIndex, RouterStats

__all__ = ["Applied", "EngineId", "EngineMatch", "RouterIndex", "RouterStats"]
