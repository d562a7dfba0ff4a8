"""pagedkv's KV events on the wire, for KV-aware routers (docs/events.md).

Needs msgspec and pyzmq (not imported by `import pagedkv`).
"""

from pagedkv.kv_events.wire import EventForm, HashForm, WireEncoder, WireOptions, hash_int

__all__ = ["EventForm", "HashForm", "WireEncoder", "WireOptions", "hash_int"]
