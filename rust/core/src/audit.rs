//! `check_invariants`: a full audit of the lifecycle contract. Exact when no other call is
//! in flight; it locks every sequence (in id order) while it counts.

use crate::error::{Error, Result};
use crate::manager::{cdiv, BlockManager};
use crate::sync::lock;

fn fail(msg: String) -> Result<()> {
    Err(Error::Invariant(msg))
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return fail(format!($($msg)+));
        }
    };
}

impl BlockManager {
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.gpu.num_blocks();
        let bs = self.block_size();
        let map = self.seqs.pin();
        let mut cells: Vec<_> = map.iter().collect();
        cells.sort_unstable_by_key(|(id, _)| **id);
        let guards: Vec<_> = cells.iter().map(|(id, c)| (**id, lock(c))).collect();

        // References from tables, and the digest each table expects of its hashed blocks.
        let mut refs = vec![0u32; n];
        let mut cpu_owner = vec![None; self.cpu.num_blocks()];
        for (id, seq) in &guards {
            ensure!(seq.alive, "sequence {id} is in the map but marked freed");
            let ntok = seq.tokens.len();
            if self.config.enable_prefix_caching {
                ensure!(
                    seq.digests.len() == ntok / bs,
                    "sequence {id} has {} digests for {ntok} tokens",
                    seq.digests.len()
                );
            } else {
                ensure!(
                    seq.digests.is_empty(),
                    "sequence {id} has digests without caching"
                );
            }
            if let Some(cpu) = &seq.cpu_blocks {
                ensure!(
                    seq.blocks.is_empty(),
                    "swapped sequence {id} holds GPU blocks"
                );
                ensure!(
                    cpu.len() >= cdiv(ntok, bs),
                    "swapped sequence {id} has {} CPU blocks for {ntok} tokens",
                    cpu.len()
                );
                for &c in cpu {
                    let slot = cpu_owner.get_mut(c as usize);
                    ensure!(
                        slot.is_some(),
                        "CPU block {c} of sequence {id} out of range"
                    );
                    let slot = slot.unwrap();
                    ensure!(slot.is_none(), "CPU block {c} held twice (sequence {id})");
                    *slot = Some(*id);
                }
                continue;
            }
            ensure!(
                seq.blocks.len() * bs >= ntok,
                "sequence {id} has {} blocks for {ntok} tokens",
                seq.blocks.len()
            );
            let expected = seq.blocks.iter().enumerate().fold(0u64, |acc, (i, &b)| {
                acc.wrapping_add(crate::sequence::mix(i, b))
            });
            ensure!(
                seq.table_digest == expected,
                "sequence {id} has a stale table digest"
            );
            for &b in &seq.blocks {
                ensure!(
                    (b as usize) < n,
                    "sequence {id} holds block {b} out of range"
                );
                refs[b as usize] += 1;
            }
        }

        // Block states against the references.
        let (mut free, mut cached) = (0, 0);
        for (b, &r) in refs.iter().enumerate() {
            let w = self.gpu.state(b as u32).load();
            ensure!(
                w.rc() == r,
                "block {b} has rc {} but {r} tables hold it",
                w.rc()
            );
            free += usize::from(w.is_free());
            cached += usize::from(w.is_cached());
        }

        // The free stack holds exactly the FREE blocks.
        let stack = self.gpu.free_snapshot();
        ensure!(
            stack.len() == free,
            "free stack has {} ids, {free} blocks are FREE",
            stack.len()
        );
        let mut seen = vec![false; n];
        for &b in &stack {
            ensure!(!seen[b as usize], "block {b} is on the free stack twice");
            seen[b as usize] = true;
            ensure!(
                self.gpu.state(b).load().is_free(),
                "block {b} on the free stack is not FREE"
            );
        }

        // The LRU queue has one live record per CACHED block.
        let mut live = vec![false; n];
        for e in self.gpu.lru_snapshot() {
            if self.gpu.lru_entry_is_live(&e) {
                ensure!(
                    !live[e.block as usize],
                    "block {} is queued live twice",
                    e.block
                );
                live[e.block as usize] = true;
            }
        }
        let live_count = live.iter().filter(|&&l| l).count();
        ensure!(
            live_count == cached,
            "{live_count} live LRU records for {cached} CACHED blocks"
        );

        // The index holds exactly the hashed blocks, once each, in the right bucket, under
        // the digests their holders expect.
        let index = self.gpu.index_snapshot();
        let mut indexed = vec![false; n];
        for &(b, in_place) in &index {
            ensure!((b as usize) < n, "index entry names block {b} out of range");
            ensure!(
                self.gpu.state(b).load().hashed(),
                "index entry names unhashed block {b}"
            );
            ensure!(
                in_place,
                "index entry for block {b} has the wrong bucket or tag"
            );
            ensure!(!indexed[b as usize], "block {b} is in the index twice");
            indexed[b as usize] = true;
        }
        let hashed = (0..n as u32)
            .filter(|&b| self.gpu.state(b).load().hashed())
            .count();
        ensure!(
            hashed == index.len(),
            "{hashed} hashed blocks but {} index entries",
            index.len()
        );
        for (id, seq) in &guards {
            for (i, &b) in seq.blocks.iter().enumerate() {
                if indexed[b as usize] {
                    let expected = seq.digests.get(i);
                    ensure!(
                        expected.is_some_and(|d| self.gpu.index_holds(b, d)),
                        "block {b} is cached under another digest than sequence {id} expects at {i}"
                    );
                }
            }
        }
        // Live LRU records carry the digest their block is indexed under.
        for e in self.gpu.lru_snapshot() {
            if self.gpu.lru_entry_is_live(&e) {
                ensure!(
                    self.gpu.index_holds(e.block, &e.digest),
                    "LRU record of block {} has a wrong digest",
                    e.block
                );
            }
        }

        // Counters.
        ensure!(
            self.gpu.num_free() == free,
            "free count {} but {free} FREE blocks",
            self.gpu.num_free()
        );
        ensure!(
            self.gpu.num_cached() == cached,
            "cached count {} but {cached} CACHED",
            self.gpu.num_cached()
        );
        ensure!(
            self.gpu.num_available() == free + cached,
            "available {} but FREE + CACHED = {}",
            self.gpu.num_available(),
            free + cached
        );

        // CPU space: every block free or held by one swapped sequence.
        let cpu_free = self.cpu.free_snapshot();
        ensure!(
            cpu_free.len() == self.cpu.num_free(),
            "CPU free count is off"
        );
        for &c in &cpu_free {
            let slot = &mut cpu_owner[c as usize];
            ensure!(
                slot.is_none(),
                "CPU block {c} is both free and held (or free twice)"
            );
            *slot = Some(u64::MAX);
        }
        ensure!(
            cpu_owner.iter().all(Option::is_some),
            "a CPU block is neither free nor held"
        );
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{BlockManager, Config, Error};

    fn manager() -> BlockManager {
        let m = BlockManager::new(Config::new(8, 2)).unwrap();
        m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
        m.check_invariants().unwrap();
        m
    }

    fn violation(m: &BlockManager) -> String {
        match m.check_invariants() {
            Err(Error::Invariant(msg)) => msg,
            other => panic!("corruption not detected: {other:?}"),
        }
    }

    #[test]
    fn detects_a_refcount_without_a_table() {
        let m = manager();
        m.gpu.state(0).share();
        assert!(violation(&m).contains("block 0 has rc 2"));
    }

    #[test]
    fn detects_a_block_lost_from_the_free_stack() {
        let m = manager();
        assert!(m.gpu.reserve(1));
        let b = m.gpu.take();
        m.gpu.state(b).release();
        assert!(violation(&m).contains("FREE"));
    }

    #[test]
    fn detects_a_table_entry_changed_behind_the_digest() {
        let m = manager();
        let map = m.seqs.pin();
        crate::sync::lock(map.get(&1).unwrap()).blocks[1] = 5;
        drop(map);
        let msg = violation(&m);
        assert!(msg.contains("rc") || msg.contains("digest"), "{msg}");
    }
}
