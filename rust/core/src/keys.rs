//! Caller keys and held registration (vLLM inside its own scheduler): a sequence whose block
//! digests come from the caller's keys (`block_hashes=`, vLLM's block hashes) instead of its
//! tokens, and `register`, which publishes the blocks a held sequence (`register=False`)
//! scheduled once their KV has arrived.

use crate::alloc::try_grow;
use crate::error::{invalid, Error, Result};
use crate::hashing::{Digest, Tag, MAX_KEY_LEN};
use crate::manager::{prefix_lock_of, BlockManager};
use crate::sequence::{Sequence, NO_HOLD};

/// The caller's keys of some full blocks, reduced to the manager's digests (and tags when
/// hits are verified). With prefix caching off only their number is kept.
#[derive(Debug, Default)]
pub(crate) struct CallerKeys {
    /// How many keys the caller gave.
    pub given: usize,
    pub digests: Vec<Digest>,
    pub tags: Vec<Tag>,
}

/// A prompt's options beyond its tokens that decide its hit: the extra keys or the caller's
/// keys, and the cap on the hit (`lookup`, `can_allocate`, `allocate`).
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptKeys<'a> {
    pub cache_salt: Option<&'a [u8]>,
    pub lora_id: Option<u64>,
    /// The caller's keys of the prompt's full blocks, in order (at most `n / block_size`).
    pub block_hashes: Option<&'a [Vec<u8>]>,
    /// The hit takes at most `max_hit_tokens / block_size` blocks.
    pub max_hit_tokens: Option<usize>,
    /// Tokens right after the hit whose KV is loaded from outside the cache (a connector's
    /// load), not computed: the groups that skip leading tokens (a state group, a window)
    /// need only the hit blocks they read past them (`Resume`). 0: none.
    pub loaded_tokens: usize,
}

impl PromptKeys<'_> {
    /// Where a prompt of `n` tokens resumes past its hit (`Resume`).
    pub(crate) fn resume(&self, n: usize) -> crate::policy::Resume {
        crate::policy::Resume {
            loaded: self.loaded_tokens,
            limit: n,
        }
    }

    /// The loaded tokens of a prompt of `n` tokens, `k` of them scheduled past the hit: they
    /// are among the scheduled ones (the KV arrives in their blocks).
    pub(crate) fn check_loaded(&self, n: usize, k: usize) -> Result<()> {
        let l = self.loaded_tokens;
        if l > k.min(n) {
            return Err(invalid(format!(
                "loaded_tokens {l} exceeds the {} tokens scheduled past the hit (loaded tokens \
                 are among them)",
                k.min(n)
            )));
        }
        Ok(())
    }

    /// The extra keys of a caller-keyed prompt are in its keys: giving both is an error.
    pub(crate) fn check(&self) -> Result<()> {
        if self.block_hashes.is_some() && (self.cache_salt.is_some() || self.lora_id.is_some()) {
            return Err(invalid(
                "cache_salt and lora_id cannot be given with block_hashes (the caller's keys \
                 carry the extra keys)",
            ));
        }
        Ok(())
    }
}

/// Every key must have 1..=`MAX_KEY_LEN` bytes.
pub(crate) fn check_key_lengths(keys: &[Vec<u8>]) -> Result<()> {
    for (i, k) in keys.iter().enumerate() {
        if k.is_empty() || k.len() > MAX_KEY_LEN {
            return Err(invalid(format!(
                "block_hashes[{i}] has {} bytes: a key has 1..={MAX_KEY_LEN}",
                k.len()
            )));
        }
    }
    Ok(())
}

/// `total` keys for a sequence of `n` tokens: at most one per full block.
pub(crate) fn check_key_count(total: usize, n: usize, block_size: usize) -> Result<()> {
    if total > n / block_size {
        return Err(invalid(format!(
            "{total} block_hashes for {n} tokens: at most one per full block ({})",
            n / block_size
        )));
    }
    Ok(())
}

impl BlockManager {
    /// Check the caller's keys and reduce them to digests (and tags): work done before any
    /// lock is taken.
    pub(crate) fn reduce_keys(&self, keys: &[Vec<u8>]) -> Result<CallerKeys> {
        check_key_lengths(keys)?;
        let mut out = CallerKeys {
            given: keys.len(),
            ..CallerKeys::default()
        };
        if !self.caching() {
            return Ok(out);
        }
        out.digests = crate::alloc::try_with_capacity(keys.len(), "the keys' digests")?;
        out.digests
            .extend(keys.iter().map(|k| self.hasher.key_digest(k)));
        if let Some(t) = &self.tagger {
            out.tags = keys.iter().map(|k| t.tag_key(k)).collect();
        }
        Ok(out)
    }

    /// Whether `keys` may continue `seq`'s key list once it holds `n` tokens: only a
    /// caller-keyed sequence takes keys, one per full block at most. Reserves the room they
    /// take, so that adding them later cannot fail.
    pub(crate) fn check_more_keys(
        &self,
        id: u64,
        seq: &mut Sequence,
        keys: &CallerKeys,
        n: usize,
    ) -> Result<()> {
        if !seq.keyed {
            return Err(invalid(format!(
                "sequence {id} hashes its own tokens: block_hashes only continue the keys of a \
                 sequence allocated with block_hashes"
            )));
        }
        check_key_count(seq.digests.len() + keys.given, n, self.block_size())?;
        try_grow(&mut seq.digests, keys.digests.len(), "a sequence's digests")?;
        try_grow(&mut seq.tags, keys.tags.len(), "a sequence's tags")
    }

    /// Append checked keys to `seq`'s digests (room reserved by `check_more_keys`).
    pub(crate) fn add_keys(seq: &mut Sequence, keys: Option<&CallerKeys>) {
        if let Some(k) = keys {
            seq.digests.extend_from_slice(&k.digests);
            seq.tags.extend_from_slice(&k.tags);
        }
    }

    /// The digests `seq` will have once `new` tokens and `keys` are added.
    pub(crate) fn digests_after(
        &self,
        seq: &Sequence,
        new: usize,
        keys: Option<&CallerKeys>,
    ) -> usize {
        if !self.caching() {
            0
        } else if seq.keyed {
            seq.digests.len() + keys.map_or(0, |k| k.digests.len())
        } else {
            (seq.tokens.len() + new) / self.block_size()
        }
    }

    /// Register the blocks of `seq` that are full of scheduled tokens and keyed, below
    /// `num_tokens` (`None`: every scheduled token), after adding `block_hashes` (a
    /// caller-keyed sequence's further keys), and lift the hold up to there (`None`: lift
    /// it). Returns how many blocks this call newly registered (in every group).
    pub fn register(
        &self,
        id: u64,
        num_tokens: Option<usize>,
        block_hashes: Option<&[Vec<u8>]>,
    ) -> Result<usize> {
        self.guarded(true, || {
            let keys = block_hashes.map(|k| self.reduce_keys(k)).transpose()?;
            self.with_seq(id, true, |seq| {
                if seq.is_swapped() {
                    return Err(Error::Swapped(id));
                }
                if let Some(t) = num_tokens {
                    if t > seq.scheduled {
                        return Err(invalid(format!(
                            "num_tokens {t} for sequence {id} must be in 0..={} (its scheduled \
                             tokens)",
                            seq.scheduled
                        )));
                    }
                }
                if let Some(k) = &keys {
                    self.check_more_keys(id, seq, k, seq.tokens.len())?;
                }
                let bs = self.block_size();
                let hold = match num_tokens {
                    None => NO_HOLD,
                    // Blocks fit a u32 (tokens fit an i32): the cast is exact.
                    Some(t) => seq.hold.max((t / bs) as u32),
                };
                let before = self.registrable(seq);
                let after = (seq.scheduled / bs)
                    .min(self.digests_after(seq, 0, keys.as_ref()))
                    .min(if hold == NO_HOLD {
                        usize::MAX
                    } else {
                        hold as usize
                    });
                let first = seq
                    .digests
                    .first()
                    .or(keys.as_ref().and_then(|k| k.digests.first()));
                let locks = match first {
                    Some(d) if after > before => vec![prefix_lock_of(d)],
                    _ => Vec::new(),
                };
                let _prefix = self.lock_prefixes(locks)?;
                Self::add_keys(seq, keys.as_ref());
                seq.hold = hold;
                debug_assert_eq!(self.registrable(seq), after.max(before));
                let range = before..self.registrable(seq);
                Ok(if self.plain() {
                    self.register_range(seq, range)
                } else {
                    self.register_groups(seq, range)
                })
            })
        })
    }

    /// The number of keys (digests) a sequence has: its caller's keys, or for a self-hashed
    /// one its full blocks' digests (0 with prefix caching off).
    pub fn num_block_hashes(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.digests.len()))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{BlockManager, Config, GroupKind, HashAlgo};

    fn manager(groups: bool) -> BlockManager {
        manager_with(groups, HashAlgo::Sha256)
    }

    fn manager_with(groups: bool, algo: HashAlgo) -> BlockManager {
        let config = Config {
            watermark: 0.0,
            hash_algo: algo,
            ..Config::new(32, 2)
        };
        if groups {
            BlockManager::with_groups(config, vec![GroupKind::Full, GroupKind::Full]).unwrap()
        } else {
            BlockManager::new(config).unwrap()
        }
    }

    fn keys(names: &[&str]) -> Vec<Vec<u8>> {
        names.iter().map(|n| n.as_bytes().to_vec()).collect()
    }

    fn opts(k: &[Vec<u8>], register: bool) -> crate::AllocateOpts<'_> {
        crate::AllocateOpts {
            keys: crate::PromptKeys {
                block_hashes: Some(k),
                ..Default::default()
            },
            register,
            ..Default::default()
        }
    }

    #[test]
    fn equal_keys_hit_across_sequences_and_other_keys_never() {
        // The truncated hash collides all the time: verified hits (tags of the keys) still
        // keep different keys apart.
        for (groups, algo) in [false, true]
            .into_iter()
            .flat_map(|g| [(g, HashAlgo::Sha256), (g, HashAlgo::Xxh3Trunc8)])
        {
            let m = manager_with(groups, algo);
            let k = keys(&["a", "b"]);
            assert_eq!(
                m.allocate_with(1, &mut vec![1, 2, 3, 4, 5], &opts(&k, true))
                    .unwrap(),
                Some(0)
            );
            // Other tokens, same keys: the keys decide the hit.
            let mut other = vec![9, 9, 9, 9, 9];
            assert_eq!(
                m.allocate_with(2, &mut other, &opts(&k, true)).unwrap(),
                Some(4)
            );
            let k2 = keys(&["x", "b"]);
            assert_eq!(
                m.allocate_with(3, &mut vec![1, 2, 3, 4, 5], &opts(&k2, true))
                    .unwrap(),
                Some(0)
            );
            // The same tokens without keys are hashed: no hit on the caller's keys.
            assert_eq!(
                m.allocate(4, &[1, 2, 3, 4, 5], None, None, 0).unwrap(),
                Some(0)
            );
            assert_eq!(m.num_block_hashes(1).unwrap(), 2);
            assert_eq!(m.num_block_hashes(4).unwrap(), 2);
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn held_blocks_register_only_when_register_lifts_the_hold() {
        for groups in [false, true] {
            let m = manager(groups);
            let k = keys(&["a", "b"]);
            let q = crate::PromptKeys {
                block_hashes: Some(&k),
                ..Default::default()
            };
            let toks = [1, 2, 3, 4, 5];
            assert_eq!(
                m.allocate_with(1, &mut toks.to_vec(), &opts(&k, false))
                    .unwrap(),
                Some(0)
            );
            assert_eq!(
                m.lookup_with(&toks, &q).unwrap(),
                0,
                "held: nothing published"
            );
            assert_eq!(
                m.register(1, Some(3), None).unwrap(),
                if groups { 2 } else { 1 }
            );
            assert_eq!(m.lookup_with(&toks, &q).unwrap(), 2, "the first block only");
            assert_eq!(
                m.register(1, None, None).unwrap(),
                if groups { 2 } else { 1 }
            );
            assert_eq!(m.lookup_with(&toks, &q).unwrap(), 4);
            assert_eq!(
                m.register(1, None, None).unwrap(),
                0,
                "nothing left to register"
            );
            assert!(
                m.register(1, Some(6), None).is_err(),
                "past the scheduled tokens"
            );
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn keys_arrive_late_and_register_what_became_registrable() {
        for groups in [false, true] {
            let m = manager(groups);
            let k = keys(&["a"]);
            assert_eq!(
                m.allocate_with(1, &mut vec![1, 2, 3, 4, 5], &opts(&k, true))
                    .unwrap(),
                Some(0)
            );
            let all = keys(&["a", "b"]);
            let q = crate::PromptKeys {
                block_hashes: Some(&all),
                ..Default::default()
            };
            assert_eq!(m.lookup_with(&[0; 5], &q).unwrap(), 2);
            // Append a token, then its key: empty tokens with keys only add keys.
            m.append_with(1, &[6], 0, None).unwrap().unwrap();
            m.append_with(1, &[], 0, Some(&keys(&["b"])))
                .unwrap()
                .unwrap();
            assert_eq!(m.lookup_with(&[0; 5], &q).unwrap(), 4);
            // Too many keys, keys for a self-hashed sequence: refused, nothing changed.
            assert!(m.append_with(1, &[], 0, Some(&keys(&["c", "d"]))).is_err());
            m.allocate(2, &[1, 2, 3], None, None, 0).unwrap().unwrap();
            assert!(m.append_with(2, &[], 0, Some(&keys(&["c"]))).is_err());
            assert!(m.register(2, None, Some(&keys(&["c"]))).is_err());
            assert_eq!(m.num_block_hashes(1).unwrap(), 2);
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn empty_append_with_lookahead_reserves_slots_only() {
        for groups in [false, true] {
            let m = manager(groups);
            m.allocate(1, &[1, 2], None, None, 0).unwrap().unwrap();
            m.append_with(1, &[], 3, None).unwrap().unwrap();
            assert_eq!(m.num_tokens(1).unwrap(), 2);
            assert_eq!(
                m.block_table(1).unwrap().len(),
                3,
                "2 + 3 slots in 3 blocks"
            );
            assert!(m.append_with(1, &[], 0, None).is_err());
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn max_hit_tokens_caps_the_hit() {
        for groups in [false, true] {
            let m = manager(groups);
            let toks = [1, 2, 3, 4, 5, 6, 7];
            m.allocate(1, &toks, None, None, 0).unwrap().unwrap();
            for (cap, want) in [(0, 0), (1, 0), (3, 2), (4, 4), (100, 6)] {
                let q = crate::PromptKeys {
                    max_hit_tokens: Some(cap),
                    ..Default::default()
                };
                assert_eq!(m.lookup_with(&toks, &q).unwrap(), want, "cap {cap}");
            }
            let o = crate::AllocateOpts {
                keys: crate::PromptKeys {
                    max_hit_tokens: Some(3),
                    ..Default::default()
                },
                ..Default::default()
            };
            assert_eq!(m.allocate_with(2, &mut toks.to_vec(), &o).unwrap(), Some(2));
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn blocks_shared_with_forks_stay_unregistered_and_truncate_lowers_the_hold() {
        for groups in [false, true] {
            let m = manager(groups);
            let k = keys(&["a", "b"]);
            let toks = vec![1, 2, 3, 4, 5];
            m.allocate_with(1, &mut toks.clone(), &opts(&k, false))
                .unwrap()
                .unwrap();
            m.fork(1, 2).unwrap();
            // Forks could key their shared blocks otherwise: neither registers them.
            assert_eq!(m.register(1, None, None).unwrap(), 0);
            m.free(2).unwrap();
            m.free(1).unwrap();
            let q = crate::PromptKeys {
                block_hashes: Some(&k),
                ..Default::default()
            };
            assert_eq!(m.lookup_with(&toks, &q).unwrap(), 0);
            // Lifted to two blocks, then truncated to one: the re-appended block waits.
            m.allocate_with(3, &mut toks.clone(), &opts(&k, false))
                .unwrap()
                .unwrap();
            m.register(3, Some(4), None).unwrap();
            m.truncate(3, 3).unwrap().unwrap();
            m.append_with(3, &[9], 0, Some(&keys(&["c"])))
                .unwrap()
                .unwrap();
            let q2 = keys(&["a", "c"]);
            let q2 = crate::PromptKeys {
                block_hashes: Some(&q2),
                ..Default::default()
            };
            assert_eq!(m.lookup_with(&[0; 5], &q2).unwrap(), 2);
            assert!(m.register(3, None, None).unwrap() > 0);
            assert_eq!(m.lookup_with(&[0; 5], &q2).unwrap(), 4);
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn bad_keys_are_refused_before_anything_changes() {
        let m = manager(false);
        let long = vec![vec![7u8; 129]];
        let empty = vec![Vec::new()];
        let three = keys(&["a", "b", "c"]);
        for k in [&long, &empty, &three] {
            assert!(m
                .allocate_with(1, &mut vec![1, 2, 3, 4, 5], &opts(k, true))
                .is_err());
        }
        let salted = crate::AllocateOpts {
            keys: crate::PromptKeys {
                cache_salt: Some(b"s"),
                block_hashes: Some(&three[..1]),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(m.allocate_with(1, &mut vec![1, 2, 3], &salted).is_err());
        assert_eq!(m.num_sequences(), 0);
        assert_eq!(m.num_free_blocks(), 32);
    }
}
