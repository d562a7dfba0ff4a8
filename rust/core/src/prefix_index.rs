//! Digest -> `(block, epoch)` of the block that holds that content. Reads are lock-free
//! (papaya never blocks a reader); a value is trusted only after `BlockState::pin` checks
//! that the block still has that epoch and is hashed.

use crate::hashing::Digest;
use crate::id_hasher::BuildIdHasher;

fn pack(block: u32, epoch: u32) -> u64 {
    (u64::from(epoch) << 32) | u64::from(block)
}

fn unpack(v: u64) -> (u32, u32) {
    (v as u32, (v >> 32) as u32)
}

pub struct PrefixIndex {
    /// Holds exactly the hashed blocks, one entry each, keyed by the digest they were
    /// registered under; an entry is removed before its block leaves the hashed state
    /// (eviction and reset bump the epoch first, so a reader racing the removal misses).
    map: papaya::HashMap<Digest, u64, BuildIdHasher>,
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> Self {
        Self {
            map: papaya::HashMap::builder()
                .capacity(capacity)
                .hasher(BuildIdHasher)
                .build(),
        }
    }

    pub fn get(&self, digest: &Digest) -> Option<(u32, u32)> {
        self.map.pin().get(digest).copied().map(unpack)
    }

    /// Register `block` under `digest` unless another block already holds that content.
    pub fn insert_new(&self, digest: Digest, block: u32, epoch: u32) -> bool {
        self.map
            .pin()
            .try_insert(digest, pack(block, epoch))
            .is_ok()
    }

    /// Remove the entry only if it still names this block incarnation.
    pub fn remove_exact(&self, digest: &Digest, block: u32, epoch: u32) -> bool {
        let want = pack(block, epoch);
        matches!(
            self.map.pin().remove_if(digest, |_, v| *v == want),
            Ok(Some(_))
        )
    }

    /// Every entry (audits).
    pub fn snapshot(&self) -> Vec<(Digest, u32, u32)> {
        let m = self.map.pin();
        m.iter()
            .map(|(d, v)| {
                let (b, e) = unpack(*v);
                (*d, b, e)
            })
            .collect()
    }
}
