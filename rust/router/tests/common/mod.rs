//! Helpers the router's integration tests share (each test file is its own crate, so a
//! helper one of them does not call is allowed to go unused there).
#![allow(dead_code)]

use pagedkv_router::{EngineKey, Event, RouterIndex};

/// A `BlockStored` of `hashes` on the GPU, group 0, no parent.
pub fn stored(hashes: &[u64]) -> Event<'static, u64> {
    Event::Stored {
        hashes: hashes.to_vec(),
        parent: None,
        medium: Some("GPU"),
        group: 0,
    }
}

/// A `BlockRemoved` of `hashes` on the GPU, group 0.
pub fn removed(hashes: &[u64]) -> Event<'static, u64> {
    Event::Removed {
        hashes: hashes.to_vec(),
        medium: Some("GPU"),
        group: 0,
    }
}

/// A 64-bit mix (splitmix64's finaliser): block hashes spread over the shards.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Each engine's matched leading blocks of `keys`, sorted.
pub fn blocks(ix: &RouterIndex<u64>, keys: &[u64]) -> Vec<(EngineKey, u32)> {
    let mut v: Vec<_> = ix
        .match_prefix(keys)
        .into_iter()
        .map(|h| (h.engine, h.blocks))
        .collect();
    v.sort();
    v
}
