//! Secret tags that confirm a prefix hit when the public digest is not collision resistant.
//!
//! xxh3 digests are public and predictable (seed 0 by default, exported in KV events), so an
//! adversary could craft a prompt whose block digest equals another prompt's. With such a hash
//! every hashed block also carries a *tag*: a second chain over the same message under
//! SipHash-1-3-128, a keyed pseudo-random function, with a 128-bit key drawn at random for
//! each manager and never exported. (A secret seed for xxh3 itself would not do: xxh3 is not
//! designed to hide its seed, and seed-independent collisions of non-cryptographic hashes are
//! reported; SipHash is built for exactly this, hash-flooding resistance under a secret key.) A hit is served only when the
//! cached block's tag equals the tag of the prompt's own prefix, so colliding on the public
//! digest alone (at any depth of the chain) buys only a missed hit. The tag chains over the
//! parent's tag, not the parent's digest, so it stands for the whole prefix.

use crate::hashing::Tag;
use siphasher::sip128::{Hasher128, SipHasher13};
use std::hash::{BuildHasher, Hasher};

const MAGIC: &[u8; 4] = b"PKVt";

#[derive(Debug, Clone)]
pub struct HitTagger {
    /// The SipHash key; never leaves the process.
    key: (u64, u64),
    root: Tag,
}

impl HitTagger {
    /// A tagger with a key nobody outside this process can predict: std's `RandomState` is
    /// keyed from the operating system's random source, and two of its outputs form the key.
    pub fn random() -> Self {
        let state = std::collections::hash_map::RandomState::new();
        Self::with_key(state.hash_one(0x7a67_u64), state.hash_one(0x7a68_u64))
    }

    /// A tagger with a chosen key (tests).
    pub fn with_key(k0: u64, k1: u64) -> Self {
        let mut h = SipHasher13::new_with_keys(k0, k1);
        h.write(b"PKVtroot");
        let root = h.finish128().as_u128();
        Self {
            key: (k0, k1),
            root,
        }
    }

    /// The parent tag of a sequence's first block.
    pub fn root(&self) -> Tag {
        self.root
    }

    pub fn tag_block(&self, parent: Tag, tokens: &[u32], extras: &[u8]) -> Tag {
        let mut h = SipHasher13::new_with_keys(self.key.0, self.key.1);
        h.write(MAGIC);
        h.write(&parent.to_le_bytes());
        h.write(&(tokens.len() as u32).to_le_bytes());
        // Tokens through a stack buffer: one `write` per 128 tokens, not one per token.
        let mut buf = [0u8; 512];
        for chunk in tokens.chunks(buf.len() / 4) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.write(&buf[..chunk.len() * 4]);
        }
        h.write(extras);
        h.finish128().as_u128()
    }

    /// The tag of a caller's block key (`BlockHasher::key_digest`'s message under the
    /// secret key): the key is a chain key already, so its tag stands for the prefix too.
    pub fn tag_key(&self, key: &[u8]) -> Tag {
        let mut h = SipHasher13::new_with_keys(self.key.0, self.key.1);
        h.write(crate::hashing::KEY_MAGIC);
        h.write(key);
        h.finish128().as_u128()
    }

    /// Tags of every full block of `tokens`.
    pub fn tag_chain(&self, tokens: &[u32], block_size: usize, extras: &[u8]) -> Vec<Tag> {
        let mut parent = self.root;
        tokens
            .chunks_exact(block_size)
            .map(|block| {
                parent = self.tag_block(parent, block, extras);
                parent
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_depend_on_the_secret_the_prefix_and_the_extras() {
        let a = HitTagger::with_key(1, 1);
        let toks = [1u32, 2, 3, 4];
        let chain = a.tag_chain(&toks, 2, &[0]);
        assert_eq!(
            chain,
            a.tag_chain(&toks, 2, &[0]),
            "deterministic for one seed"
        );
        assert_ne!(chain, HitTagger::with_key(2, 1).tag_chain(&toks, 2, &[0]));
        assert_ne!(chain, a.tag_chain(&toks, 2, &[1]));
        // Same second block under another first block: another tag.
        assert_ne!(chain[1], a.tag_chain(&[9, 2, 3, 4], 2, &[0])[1]);
        assert_ne!(HitTagger::random().root(), HitTagger::random().root());
        assert_eq!(a.tag_key(b"k"), a.tag_key(b"k"));
        assert_ne!(a.tag_key(b"k"), a.tag_key(b"j"));
        assert_ne!(a.tag_key(b"k"), HitTagger::with_key(2, 1).tag_key(b"k"));
    }
}
