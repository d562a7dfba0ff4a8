//! Chained block digests, encoding version 1 (spec and test vectors: `docs/hashing.md`).

use sha2::{Digest as _, Sha256};
use std::hash::{Hash, Hasher};

/// The hash function behind the digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashAlgo {
    /// SHA-256, 32-byte digests: collision resistant, the default.
    Sha256,
    /// XXH3-128 (seed 0), 16-byte canonical digests: fast and predictable, so hits are
    /// verified with a secret tag (`docs/security.md`).
    Xxh3_128,
    /// TEST ONLY: XXH3-128 with all but its first byte zeroed, so that different blocks share
    /// digests all the time. Hits are verified as for `Xxh3_128`, so this is safe (only slow
    /// and hit-poor); it exists to prove that a digest collision never serves another
    /// prompt's KV (`tests/core/test_collisions.py`, `rust/core/tests/collisions.rs`).
    Xxh3Trunc8,
}

impl HashAlgo {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "sha256" => Some(Self::Sha256),
            "xxh3_128" => Some(Self::Xxh3_128),
            "xxh3_128_trunc8_testing" => Some(Self::Xxh3Trunc8),
            _ => None,
        }
    }

    pub fn digest_len(self) -> usize {
        match self {
            Self::Sha256 => 32,
            Self::Xxh3_128 | Self::Xxh3Trunc8 => 16,
        }
    }

    /// Whether an adversary could make two different blocks share a digest, so that a hit
    /// must be confirmed with a secret tag before it is served.
    pub fn needs_verified_hits(self) -> bool {
        self != Self::Sha256
    }
}

/// A secret, per-manager chain digest of a full block (`BlockHasher::tag_chain`): what a prefix
/// hit compares when the public digest is not collision resistant.
pub type Tag = u128;

/// A block digest: `len` meaningful bytes, the rest zero.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Digest {
    bytes: [u8; 32],
    len: u8,
}

/// `GROUP_STREAMS[g]`: the words group `g`'s keys XOR into a digest (`Digest::keyed`):
/// splitmix64 of the group, one word per 8 bytes of digest; group 0's are zero. A table, so
/// that keying costs four XORs, not four mixes (hybrid hits key every look).
static GROUP_STREAMS: [[u64; 4]; 256] = group_streams();

const fn group_streams() -> [[u64; 4]; 256] {
    let mut out = [[0u64; 4]; 256];
    let mut g = 1;
    while g < 256 {
        let mut z = g as u64;
        let mut w = 0;
        while w < 4 {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            out[g][w] = x ^ (x >> 31);
            w += 1;
        }
        g += 1;
    }
    out
}

impl Digest {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// The 32 bytes as four little-endian words (zero padded), for atomic storage.
    #[inline]
    pub fn words(&self) -> [u64; 4] {
        let mut out = [0u64; 4];
        for (w, chunk) in out.iter_mut().zip(self.bytes.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        out
    }

    /// The key this digest is cached under in KV-cache group `group`: the digest itself for
    /// group 0, else its meaningful bytes XORed with a fixed stream of the group's (one pool
    /// holds every group's blocks, and a prompt's blocks in two groups must not collide).
    /// An involution: keying a key with the same group gives the digest back. Two keys of
    /// different groups collide only if their digests differ by exactly the XOR of the two
    /// streams, which for a collision-resistant digest is as hard as a collision.
    #[inline]
    pub fn keyed(&self, group: u8) -> Digest {
        if group == 0 {
            return *self;
        }
        let stream = &GROUP_STREAMS[group as usize];
        let mut out = *self;
        let len = self.len as usize;
        for (i, k) in stream.iter().enumerate() {
            let lo = 8 * i;
            if lo >= len {
                break;
            }
            // Whole words (every digest length is a multiple of 8), XORed as words.
            let mut w = [0u8; 8];
            w.copy_from_slice(&out.bytes[lo..lo + 8]);
            let x = (u64::from_le_bytes(w) ^ k).to_le_bytes();
            let n = (len - lo).min(8);
            out.bytes[lo..lo + n].copy_from_slice(&x[..n]);
        }
        out
    }

    /// Inverse of `words`, for a digest of `len` bytes.
    pub fn from_words(words: [u64; 4], len: usize) -> Self {
        let mut bytes = [0u8; 32];
        for (chunk, w) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        Self {
            bytes,
            len: len as u8,
        }
    }

    fn from_slice(s: &[u8]) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..s.len()].copy_from_slice(s);
        Self {
            bytes,
            len: s.len() as u8,
        }
    }
}

impl Hash for Digest {
    // The bytes are already uniformly distributed: eight of them are a good map key.
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut first = [0u8; 8];
        first.copy_from_slice(&self.bytes[..8]);
        state.write_u64(u64::from_le_bytes(first));
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The extra keys of a sequence, encoded once: flags byte, then salt and LoRA id.
pub fn encode_extras(salt: Option<&[u8]>, lora_id: Option<u64>) -> Vec<u8> {
    let flags = u8::from(salt.is_some()) | (u8::from(lora_id.is_some()) << 1);
    let mut out = vec![flags];
    if let Some(s) = salt {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s);
    }
    if let Some(id) = lora_id {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

const MAGIC: &[u8; 4] = b"PKV1";

/// The first bytes of a caller key's message (`BlockHasher::key_digest`): no block message
/// (`MAGIC`) or root message (`PKV1root`) starts with them, so a caller key's digest is
/// never a token chain's.
pub const KEY_MAGIC: &[u8; 4] = b"PKVk";

/// The longest caller key (`block_hashes=`), in bytes.
pub const MAX_KEY_LEN: usize = 128;

/// The one-shot path's buffer: six 64-byte blocks, for blocks of up to 64 tokens with short
/// extras (longer ones stream).
const SHORT_BLOCKS: usize = 6;
/// The longest message that fits `SHORT_BLOCKS` with SHA-256's padding (0x80, then a 64-bit
/// length).
const SHORT_MAX: usize = 64 * SHORT_BLOCKS - 9;

/// The block message (above), zero filled to `N` 64-byte blocks.
fn encode<const N: usize>(parent: &Digest, tokens: &[u32], extras: &[u8]) -> [[u8; 64]; N] {
    let mut blocks = [[0u8; 64]; N];
    let buf = blocks.as_flattened_mut();
    let count = (tokens.len() as u32).to_le_bytes();
    let mut at = 0;
    for part in [&MAGIC[..], parent.as_bytes(), &count] {
        buf[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    at += fill_le(&mut buf[at..], tokens);
    buf[at..at + extras.len()].copy_from_slice(extras);
    blocks
}

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// SHA-256 of the first `len` bytes of `blocks` (the rest zero), padded in place (FIPS 180-4,
/// 5.1.1) and compressed directly from the IV: `Sha256::digest` copies the message through
/// its block buffer and pads in a second one, about 13 ns of a 16-token block's 125.
fn sha256_padded<const N: usize>(mut blocks: [[u8; 64]; N], len: usize) -> Digest {
    let n = (len + 9).div_ceil(64);
    let buf = blocks.as_flattened_mut();
    buf[len] = 0x80;
    buf[64 * n - 8..64 * n].copy_from_slice(&(8 * len as u64).to_be_bytes());
    let mut state = SHA256_IV;
    // One call per block: `compress256` takes `GenericArray`s, and a whole-buffer copy into
    // them costs more (it reloads bytes just stored) than a call.
    for block in &blocks[..n] {
        sha2::compress256(&mut state, std::slice::from_ref(block.into()));
    }
    let mut bytes = [0u8; 32];
    for (out, word) in bytes.chunks_exact_mut(4).zip(state) {
        out.copy_from_slice(&word.to_be_bytes());
    }
    Digest { bytes, len: 32 }
}

/// Hashes blocks for one manager: algorithm plus root digest.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    root: Digest,
}

impl BlockHasher {
    pub fn new(algo: HashAlgo, seed: u64) -> Self {
        let mut msg = b"PKV1root".to_vec();
        msg.extend_from_slice(&seed.to_le_bytes());
        let root = Self::digest_of(algo, &[&msg]);
        Self { algo, root }
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The parent digest of a sequence's first block.
    pub fn root(&self) -> Digest {
        self.root
    }

    /// The digest of one full block, given its parent's digest and the encoded extras.
    pub fn hash_block(&self, parent: &Digest, tokens: &[u32], extras: &[u8]) -> Digest {
        // The usual block is encoded whole into a stack buffer and hashed in one call: the
        // streaming API's per-update buffering costs nearly half as much as SHA-256's
        // compression itself on 16-token blocks.
        let len = MAGIC.len() + parent.as_bytes().len() + 4 + 4 * tokens.len() + extras.len();
        if len <= SHORT_MAX {
            return match self.algo {
                // 16-token blocks with short extras take two SHA-256 blocks: a buffer of just
                // that size is zeroed with a few stores rather than a `memset` call.
                HashAlgo::Sha256 if len <= 2 * 64 - 9 => {
                    sha256_padded(encode::<2>(parent, tokens, extras), len)
                }
                HashAlgo::Sha256 => {
                    sha256_padded(encode::<SHORT_BLOCKS>(parent, tokens, extras), len)
                }
                HashAlgo::Xxh3_128 | HashAlgo::Xxh3Trunc8 => {
                    let blocks = encode::<SHORT_BLOCKS>(parent, tokens, extras);
                    self.finish_xxh3(xxhash_rust::xxh3::xxh3_128(&blocks.as_flattened()[..len]))
                }
            };
        }
        let count = (tokens.len() as u32).to_le_bytes();
        // Long blocks stream the tokens through a buffer: no allocation per block.
        let mut buf = [0u8; 1024];
        match self.algo {
            HashAlgo::Sha256 => {
                let mut h = Sha256::new();
                h.update(MAGIC);
                h.update(parent.as_bytes());
                h.update(count);
                for chunk in tokens.chunks(buf.len() / 4) {
                    let n = fill_le(&mut buf, chunk);
                    h.update(&buf[..n]);
                }
                h.update(extras);
                Digest::from_slice(&h.finalize())
            }
            HashAlgo::Xxh3_128 | HashAlgo::Xxh3Trunc8 => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(MAGIC);
                h.update(parent.as_bytes());
                h.update(&count);
                for chunk in tokens.chunks(buf.len() / 4) {
                    let n = fill_le(&mut buf, chunk);
                    h.update(&buf[..n]);
                }
                h.update(extras);
                self.finish_xxh3(h.digest128())
            }
        }
    }

    fn finish_xxh3(&self, d: u128) -> Digest {
        let mut bytes = d.to_be_bytes();
        if self.algo == HashAlgo::Xxh3Trunc8 {
            bytes[1..].fill(0);
        }
        Digest::from_slice(&bytes)
    }

    /// The digest of a caller's block key (vLLM's block hash, already a chain key): the hash
    /// of `KEY_MAGIC` then the key's bytes. Equal keys give equal digests.
    pub fn key_digest(&self, key: &[u8]) -> Digest {
        Self::digest_of(self.algo, &[KEY_MAGIC, key])
    }

    /// Chain digests of every full block of `tokens`.
    pub fn hash_chain(&self, tokens: &[u32], block_size: usize, extras: &[u8]) -> Vec<Digest> {
        let mut parent = self.root;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                parent = self.hash_block(&parent, block, extras);
                parent
            })
            .collect()
    }

    fn digest_of(algo: HashAlgo, parts: &[&[u8]]) -> Digest {
        match algo {
            HashAlgo::Sha256 => {
                let mut h = Sha256::new();
                parts.iter().for_each(|p| h.update(p));
                Digest::from_slice(&h.finalize())
            }
            HashAlgo::Xxh3_128 | HashAlgo::Xxh3Trunc8 => {
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                parts.iter().for_each(|p| h.update(p));
                let mut bytes = h.digest128().to_be_bytes();
                if algo == HashAlgo::Xxh3Trunc8 {
                    bytes[1..].fill(0);
                }
                Digest::from_slice(&bytes)
            }
        }
    }
}

/// `n` distinct sample digests (unit tests of the index and the pool).
#[cfg(all(test, not(loom)))]
pub(crate) fn sample_digests(n: u32) -> Vec<Digest> {
    let h = BlockHasher::new(HashAlgo::Sha256, 0);
    (0..n)
        .map(|i| h.hash_block(&h.root(), &[i], &[0]))
        .collect()
}

#[inline]
fn fill_le(buf: &mut [u8], tokens: &[u32]) -> usize {
    for (dst, t) in buf.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    tokens.len() * 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_keys_are_involutions_distinct_per_group_and_keep_the_length() {
        for algo in [HashAlgo::Sha256, HashAlgo::Xxh3_128] {
            let h = BlockHasher::new(algo, 0);
            let d = h.hash_block(&h.root(), &[1, 2, 3], &[]);
            assert_eq!(d.keyed(0), d, "group 0 is the plain digest");
            let keys: Vec<Digest> = (0..=255u8).map(|g| d.keyed(g)).collect();
            let distinct: std::collections::HashSet<_> = keys.iter().map(Digest::words).collect();
            assert_eq!(
                distinct.len(),
                256,
                "{algo:?}: every group gets its own key"
            );
            for (g, k) in keys.iter().enumerate() {
                assert_eq!(k.keyed(g as u8), d, "keying twice gives the digest back");
                assert_eq!(k.as_bytes().len(), d.as_bytes().len());
                // Bytes past the digest's length stay zero (words() pads with them).
                if d.as_bytes().len() == 16 {
                    assert_eq!(k.words()[2..], [0, 0]);
                }
            }
        }
    }

    #[test]
    fn key_digests_hash_the_magic_then_the_key_and_differ_from_chains() {
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        let d = h.key_digest(b"abc");
        assert_eq!(d.as_bytes(), Sha256::digest(b"PKVkabc").as_slice());
        assert_eq!(d, h.key_digest(b"abc"), "equal keys, equal digests");
        assert_ne!(d, h.key_digest(b"abd"));
        let x = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        assert_eq!(
            x.key_digest(b"abc").as_bytes(),
            xxhash_rust::xxh3::xxh3_128(b"PKVkabc")
                .to_be_bytes()
                .as_slice()
        );
        // A key that is a chain digest's bytes is not that digest (domain separation).
        let chain = h.hash_chain(&[1, 2], 2, &[0])[0];
        assert_ne!(h.key_digest(chain.as_bytes()), chain);
    }

    #[test]
    fn sha256_root_matches_a_hand_built_message() {
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        let mut msg = b"PKV1root".to_vec();
        msg.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(h.root().as_bytes(), Sha256::digest(&msg).as_slice());
    }

    #[test]
    fn block_digest_matches_the_spec_encoding() {
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        let extras = encode_extras(Some(b"s"), Some(7));
        let d = h.hash_block(&h.root(), &[1, 2], &extras);
        let mut msg = b"PKV1".to_vec();
        msg.extend_from_slice(h.root().as_bytes());
        msg.extend_from_slice(&2u32.to_le_bytes());
        msg.extend_from_slice(&1u32.to_le_bytes());
        msg.extend_from_slice(&2u32.to_le_bytes());
        msg.push(0b11);
        msg.extend_from_slice(&1u32.to_le_bytes());
        msg.push(b's');
        msg.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(d.as_bytes(), Sha256::digest(&msg).as_slice());
    }

    #[test]
    fn long_blocks_stream_to_the_same_digest_as_the_encoding() {
        // 300 tokens do not fit the one-shot buffer: the streaming path must agree with it.
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        let toks: Vec<u32> = (0..300).map(|t| t * 7919).collect();
        let mut msg = b"PKV1".to_vec();
        msg.extend_from_slice(h.root().as_bytes());
        msg.extend_from_slice(&300u32.to_le_bytes());
        toks.iter()
            .for_each(|t| msg.extend_from_slice(&t.to_le_bytes()));
        msg.push(0);
        let d = h.hash_block(&h.root(), &toks, &[0]);
        assert_eq!(d.as_bytes(), Sha256::digest(&msg).as_slice());
        let x = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let mut xmsg = b"PKV1".to_vec();
        xmsg.extend_from_slice(x.root().as_bytes());
        xmsg.extend_from_slice(&msg[4 + 32..]);
        let xd = x.hash_block(&x.root(), &toks, &[0]);
        assert_eq!(
            xd.as_bytes(),
            xxhash_rust::xxh3::xxh3_128(&xmsg).to_be_bytes().as_slice()
        );
    }

    #[test]
    fn one_shot_digests_match_the_spec_message_at_every_padding_edge() {
        // Messages are 40 + 4 * tokens + extras bytes: these sizes cross the one-, two- and
        // six-block edges (55/56/64 bytes and so on) and the streaming path beyond 375 bytes.
        for algo in [HashAlgo::Sha256, HashAlgo::Xxh3_128] {
            let h = BlockHasher::new(algo, 3);
            for tokens in [
                1u32, 2, 3, 4, 5, 6, 7, 8, 13, 14, 16, 17, 18, 32, 64, 80, 83, 84, 128, 256,
            ] {
                let toks: Vec<u32> = (0..tokens).map(|t| t.wrapping_mul(2_654_435_761)).collect();
                for extras_len in (0..=20).chain([50, 63, 64, 65, 200]) {
                    let extras: Vec<u8> = (0..extras_len).map(|i| i as u8 ^ 0xa5).collect();
                    let mut msg = b"PKV1".to_vec();
                    msg.extend_from_slice(h.root().as_bytes());
                    msg.extend_from_slice(&tokens.to_le_bytes());
                    toks.iter()
                        .for_each(|t| msg.extend_from_slice(&t.to_le_bytes()));
                    msg.extend_from_slice(&extras);
                    let want = match algo {
                        HashAlgo::Sha256 => Sha256::digest(&msg).to_vec(),
                        _ => xxhash_rust::xxh3::xxh3_128(&msg).to_be_bytes().to_vec(),
                    };
                    let got = h.hash_block(&h.root(), &toks, &extras);
                    assert_eq!(got.as_bytes(), want, "{algo:?} {} bytes", msg.len());
                }
            }
        }
    }

    #[test]
    fn chain_depends_on_parent_salt_lora_seed_and_algo() {
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        let toks = [5u32, 6, 5, 6];
        let plain = h.hash_chain(&toks, 2, &encode_extras(None, None));
        assert_eq!(plain.len(), 2);
        assert_ne!(plain[0], plain[1], "same tokens, different parents");
        let salted = h.hash_chain(&toks, 2, &encode_extras(Some(b"a"), None));
        let lora = h.hash_chain(&toks, 2, &encode_extras(None, Some(1)));
        let seeded = BlockHasher::new(HashAlgo::Sha256, 1).hash_chain(&toks, 2, &[0]);
        let xxh = BlockHasher::new(HashAlgo::Xxh3_128, 0).hash_chain(&toks, 2, &[0]);
        for other in [&salted, &lora, &seeded, &xxh] {
            assert_ne!(other[0], plain[0]);
        }
        assert_eq!(xxh[0].as_bytes().len(), 16);
        // Partial blocks are not hashed; long blocks cross the stack buffer's chunks.
        assert_eq!(h.hash_chain(&toks[..3], 2, &[0]).len(), 1);
        let long: Vec<u32> = (0..1000).collect();
        assert_eq!(h.hash_chain(&long, 300, &[0]).len(), 3);
    }
}
