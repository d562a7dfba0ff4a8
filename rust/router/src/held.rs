//! `HeldSet`: the blocks one engine's stream says it holds, per (medium, group), kept by a
//! publisher so that it can write them out as compact snapshot parts (`compact.rs`) at memory
//! speed. It applies the same vLLM payloads the publisher sends, decoded here (`wire.rs`),
//! with the index's semantics: `BlockStored` adds, `BlockRemoved` removes, `AllBlocksCleared`
//! empties every holder.

use crate::compact;
use crate::error::RouterError;
use crate::event::Event;
use crate::key::{BlockKey, BuildKeyHasher};
use crate::wire;
use std::collections::{HashMap, HashSet};

type Holder = (Option<Box<str>>, u16);

pub struct HeldSet<K: BlockKey> {
    holders: HashMap<Holder, HashSet<K, BuildKeyHasher>>,
    hasher: BuildKeyHasher,
}

impl<K: BlockKey> Default for HeldSet<K> {
    fn default() -> Self {
        Self {
            holders: HashMap::new(),
            hasher: BuildKeyHasher::random(),
        }
    }
}

impl<K: BlockKey> HeldSet<K> {
    /// Apply one vLLM payload; one that does not decode is refused whole (nothing changes).
    pub fn apply_payload(&mut self, payload: &[u8]) -> Result<(), RouterError> {
        let batch = wire::decode::<K>(payload)?;
        for e in batch.events {
            match e {
                Event::Stored {
                    hashes,
                    medium,
                    group,
                    ..
                } => {
                    let hasher = self.hasher;
                    self.holders
                        .entry((medium.map(Box::from), group))
                        .or_insert_with(|| HashSet::with_hasher(hasher))
                        .extend(hashes);
                }
                Event::Removed {
                    hashes,
                    medium,
                    group,
                } => {
                    let key = (medium.map(Box::from), group);
                    if let Some(set) = self.holders.get_mut(&key) {
                        for h in &hashes {
                            set.remove(h);
                        }
                        if set.is_empty() {
                            self.holders.remove(&key);
                        }
                    }
                }
                Event::Cleared => self.holders.clear(),
            }
        }
        Ok(())
    }

    /// Blocks held, over every holder.
    pub fn len(&self) -> usize {
        self.holders.values().map(HashSet::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Every block as compact parts of at most `per_part` keys (holders in a fixed order:
    /// medium, then group).
    pub fn parts(&self, per_part: usize) -> Vec<Vec<u8>> {
        let per_part = per_part.max(1);
        let mut holders: Vec<_> = self.holders.iter().collect();
        holders.sort_by(|a, b| a.0.cmp(b.0));
        let mut out = Vec::new();
        for ((medium, group), set) in holders {
            let mut left = set.len();
            let mut keys = set.iter();
            while left > 0 {
                let n = left.min(per_part);
                let mut part = compact::header::<K>(medium.as_deref(), *group, n);
                for k in keys.by_ref().take(n) {
                    k.pack(&mut part);
                }
                out.push(part);
                left -= n;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::RouterIndex;
    use crate::EngineKey;

    /// A vLLM payload (map form) of one event, written by hand: [ts, [event], rank].
    fn payload(event: &[u8]) -> Vec<u8> {
        let mut p = vec![0x93, 0x00, 0x91];
        p.extend_from_slice(event);
        p.push(0xc0);
        p
    }

    fn stored(hashes: &[u64], medium: &str) -> Vec<u8> {
        let mut e = vec![0x83];
        e.extend_from_slice(b"\xa4type\xabBlockStored");
        e.extend_from_slice(b"\xacblock_hashes");
        e.push(0x90 | hashes.len() as u8);
        for h in hashes {
            e.push(0xcf);
            e.extend_from_slice(&h.to_be_bytes());
        }
        e.extend_from_slice(b"\xa6medium");
        e.push(0xa0 | medium.len() as u8);
        e.extend_from_slice(medium.as_bytes());
        payload(&e)
    }

    #[test]
    fn its_parts_rebuild_the_same_blocks_in_an_index() {
        let mut held = HeldSet::<u64>::default();
        held.apply_payload(&stored(&[1, 2, 3, u64::MAX], "GPU"))
            .unwrap();
        held.apply_payload(&stored(&[9], "CPU")).unwrap();
        assert_eq!(held.len(), 5);
        let parts = held.parts(3);
        assert_eq!(parts.len(), 3); // GPU in two parts, CPU in one
        let ix = RouterIndex::<u64>::default();
        let e = EngineKey::from("e");
        ix.begin_snapshot(&e);
        for p in &parts {
            ix.apply_staged_payload(&e, p).unwrap();
        }
        ix.commit_snapshot(&e).unwrap();
        let mut gpu = ix.blocks_of(&e, Some("GPU"), 0);
        gpu.sort_unstable();
        assert_eq!(gpu, vec![1, 2, 3, u64::MAX]);
        assert_eq!(ix.blocks_of(&e, Some("CPU"), 0), vec![9]);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn a_bad_payload_changes_nothing() {
        let mut held = HeldSet::<u64>::default();
        held.apply_payload(&stored(&[1], "GPU")).unwrap();
        let mut bad = stored(&[2], "GPU");
        bad.pop();
        assert!(held.apply_payload(&bad).is_err());
        assert_eq!(held.len(), 1);
    }
}
