//! Test helpers: digests from names, records, draining a policy, a fixed random sequence.

use super::Policy;
use crate::hashing::Digest;
use crate::lru_queue::Entry;

/// A digest stand-in for `name` (at most 24 bytes): word 0 a hash of it (the map key),
/// words 1 to 3 its bytes, so that distinct names give distinct digests.
pub(crate) fn k(name: &str) -> Digest {
    let bytes = name.as_bytes();
    assert!(bytes.len() <= 24, "test key {name:?} is too long");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325; // FNV-1a
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut words = [h, 0, 0, 0];
    for (i, &b) in bytes.iter().enumerate() {
        words[1 + i / 8] |= u64::from(b) << (8 * (i % 8));
    }
    Digest::from_words(words, 32)
}

/// The record of `block` cached under `name`.
pub(crate) fn entry(block: u32, name: &str) -> Entry {
    Entry {
        block,
        generation: 0,
        digest: k(name),
    }
}

/// Every victim until the set is empty.
pub(crate) fn drain(p: &mut dyn Policy) -> Vec<u32> {
    std::iter::from_fn(|| p.victim().map(|e| e.block)).collect()
}

/// xorshift64: a fixed sequence, no dependency.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
