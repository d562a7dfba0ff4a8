//! The events an index applies: vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`,
//! reduced to what an index keeps. Token ids, block size, LoRA and cache-spec fields are
//! already folded into the block hashes; the index reads only hashes, parent, medium and group.

/// One KV event. `medium` is borrowed (from the payload when decoded): `None` is vLLM's
/// unset medium, a medium of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event<'a, K> {
    /// Blocks stored, each the child of the one before; the first is the child of `parent`
    /// (`None`: a prefix's first block, or a tier event that names no parent).
    Stored {
        hashes: Vec<K>,
        parent: Option<K>,
        medium: Option<&'a str>,
        group: u16,
    },
    /// Blocks no longer held (evicted).
    Removed {
        hashes: Vec<K>,
        medium: Option<&'a str>,
        group: u16,
    },
    /// Every block of the engine is gone, in every medium and group (vLLM's
    /// `reset_prefix_cache`; pagedkv's publisher sends it before a resync's snapshot).
    Cleared,
}
