//! Block keys (the hashes engines publish) and the hasher of the index's maps.
//!
//! An index holds keys of one form, chosen at construction: vLLM's integer hashes (`u64`:
//! what vLLM sends with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, and pagedkv's default wire
//! form, the low 64 bits of the digest read big-endian), or whole digests of a fixed width
//! (`[u8; 16]` for xxh3-128, `[u8; 32]` for SHA-256). Keys are compared whole, so the index
//! answers exactly for the keys it is given: a digest index never mistakes two digests that
//! share their low 64 bits.

use std::fmt::Debug;
use std::hash::{BuildHasher, Hash, Hasher};

/// A block hash as the index stores it.
pub trait BlockKey: Copy + Eq + Hash + Default + Send + Sync + Debug + 'static {
    /// Bytes per key on the wire: 0 for the integer form.
    const WIDTH: usize;

    /// The key of a wire integer (the integer form only).
    fn from_int(v: u64) -> Option<Self>;

    /// The key of a wire byte string (the digest forms only, and only of their width).
    fn from_bytes(b: &[u8]) -> Option<Self>;

    /// Bytes per key in a compact snapshot (`compact.rs`): 8 for the integer form.
    const PACKED: usize;

    /// The key as a compact snapshot writes it (an integer little-endian, a digest as is).
    fn pack(&self, out: &mut Vec<u8>);

    /// The key of `PACKED` bytes written by `pack`.
    fn unpack(b: &[u8]) -> Self;

    /// 64 bits that stand for the key in hashing (keys are hashes already: no need to read
    /// all of a digest, but every byte is folded in so that a key chosen by its low bytes
    /// alone does not cluster).
    fn fold(&self) -> u64;
}

impl BlockKey for u64 {
    const WIDTH: usize = 0;
    const PACKED: usize = 8;

    fn pack(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }

    fn unpack(b: &[u8]) -> Self {
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }

    fn from_int(v: u64) -> Option<Self> {
        Some(v)
    }

    fn from_bytes(_: &[u8]) -> Option<Self> {
        None
    }

    fn fold(&self) -> u64 {
        *self
    }
}

macro_rules! digest_key {
    ($n:expr) => {
        impl BlockKey for [u8; $n] {
            const WIDTH: usize = $n;
            const PACKED: usize = $n;

            fn pack(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(self);
            }

            fn unpack(b: &[u8]) -> Self {
                b.try_into().expect("the key's width")
            }

            fn from_int(_: u64) -> Option<Self> {
                None
            }

            fn from_bytes(b: &[u8]) -> Option<Self> {
                b.try_into().ok()
            }

            fn fold(&self) -> u64 {
                fold_bytes(self)
            }
        }
    };
}

digest_key!(16);
digest_key!(32);

fn fold_bytes(b: &[u8]) -> u64 {
    let mut acc = 0u64;
    for chunk in b.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        acc = acc.rotate_left(23) ^ u64::from_le_bytes(w);
    }
    acc
}

/// splitmix64's finaliser: every input bit moves every output bit, so sequential integer
/// hashes (some engines publish counters) spread over the table.
#[inline]
pub(crate) fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of the block map: a block and one word (64 holders) of its holder bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryKey<K> {
    pub key: K,
    pub word: u32,
}

impl<K: BlockKey> Hash for EntryKey<K> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.key.fold() ^ u64::from(self.word).wrapping_mul(0x9e37_79b9));
    }
}

/// The hasher of every map in the index: a seeded mix of the words written to it. The seed
/// is drawn per index, so that no fixed set of keys collides in every index.
#[derive(Debug, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0 = self.0.rotate_left(29) ^ fold_bytes(bytes);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(29) ^ n;
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[derive(Debug, Clone, Copy)]
pub struct BuildKeyHasher {
    seed: u64,
}

impl BuildKeyHasher {
    /// A hasher with a seed drawn from the process's random state.
    pub fn random() -> Self {
        Self {
            seed: std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64),
        }
    }
}

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widths_are_checked() {
        assert_eq!(<[u8; 32]>::from_bytes(&[1; 32]), Some([1; 32]));
        assert_eq!(<[u8; 32]>::from_bytes(&[1; 16]), None);
        assert_eq!(<[u8; 16]>::from_int(3), None);
        assert_eq!(u64::from_bytes(&[0; 8]), None);
        assert_eq!(u64::from_int(7), Some(7));
    }

    #[test]
    fn sequential_integers_spread() {
        let h = BuildKeyHasher::random();
        let buckets: std::collections::HashSet<u64> = (0..1024u64)
            .map(|i| h.hash_one(EntryKey { key: i, word: 0 }) & 1023)
            .collect();
        assert!(buckets.len() > 500, "{}", buckets.len());
    }
}
