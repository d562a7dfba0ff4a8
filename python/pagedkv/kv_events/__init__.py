"""pagedkv's KV events on the wire, for KV-aware routers (docs/events.md).

Needs msgspec and pyzmq (not imported by `import pagedkv`).
"""

from pagedkv.kv_events.blockset import Block, BlockSet
from pagedkv.kv_events.publisher import Publisher
from pagedkv.kv_events.subscriber import RecoveryError, Subscriber
from pagedkv.kv_events.wire import EventForm, HashForm, WireEncoder, WireOptions, decoder, hash_int

__all__ = [
    "Block",
    "BlockSet",
    "EventForm",
    "HashForm",
    "Publisher",
    "RecoveryError",
    "Subscriber",
    "WireEncoder",
    "WireOptions",
    "decoder",
    "hash_int",
]
