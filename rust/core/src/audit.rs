//! `check_invariants`: a full audit of the lifecycle contract. Exact when no other call is
//! in flight; it locks every sequence (in id order) while it counts.

use crate::error::ensure_invariant as ensure;
use crate::error::Result;
use crate::manager::{cdiv, BlockManager};
use crate::sync::lock;

impl BlockManager {
    pub fn check_invariants(&self) -> Result<()> {
        let n = self.gpu.num_blocks();
        let bs = self.block_size();
        let cells = self.seqs.cells();
        // Pending cells (a creation in flight) hold no blocks yet; only live ones count.
        let guards: Vec<_> = cells
            .iter()
            .map(|(id, c)| (*id, lock(&c.seq), c.is_live()))
            .filter(|(_, _, live)| *live)
            .map(|(id, g, _)| (id, g))
            .collect();
        ensure!(
            guards.len() == self.seqs.len(),
            "{} live sequences but the count says {}",
            guards.len(),
            self.seqs.len()
        );

        // References from tables, and the digest each table expects of its hashed blocks.
        let mut refs = vec![0u32; n];
        let mut cpu_owner = vec![None; self.cpu.num_blocks()];
        for (id, seq) in &guards {
            let ntok = seq.tokens.len();
            let sched = seq.scheduled;
            ensure!(
                sched <= ntok && seq.hit_blocks * bs <= sched,
                "sequence {id} has {sched} scheduled tokens of {ntok}, {} hit blocks",
                seq.hit_blocks
            );
            if self.config.enable_prefix_caching {
                // A caller-keyed sequence has a digest per key, at most one per full block.
                ensure!(
                    seq.digests.len() == ntok / bs || seq.keyed && seq.digests.len() < ntok / bs,
                    "sequence {id} has {} digests for {ntok} tokens",
                    seq.digests.len()
                );
                let tags = if self.tagger.is_some() {
                    seq.digests.len()
                } else {
                    0
                };
                ensure!(
                    seq.tags.len() == tags,
                    "sequence {id} has {} tags, expected {tags}",
                    seq.tags.len()
                );
            } else {
                ensure!(
                    seq.digests.is_empty(),
                    "sequence {id} has digests without caching"
                );
            }
            if let Some(cpu) = &seq.cpu_blocks {
                ensure!(
                    seq.blocks.is_empty() && seq.more().is_empty(),
                    "swapped sequence {id} holds GPU blocks"
                );
                ensure!(
                    cpu.len() >= cdiv(sched, bs),
                    "swapped sequence {id} has {} CPU blocks for {sched} scheduled tokens",
                    cpu.len()
                );
                ensure!(
                    seq.cpu_more().len() + 1 == self.kinds.len()
                        && seq.cpu_more().iter().all(|t| t.len() == cpu.len()),
                    "swapped sequence {id} has CPU tables of other shapes than its groups"
                );
                for c in Self::cpu_held(seq) {
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
                seq.blocks.len() * bs >= sched,
                "sequence {id} has {} blocks for {sched} scheduled tokens",
                seq.blocks.len()
            );
            let expected = seq.blocks.iter().enumerate().fold(0u64, |acc, (i, &b)| {
                acc.wrapping_add(crate::sequence::mix(i, b))
            });
            ensure!(
                seq.table_digest == expected,
                "sequence {id} has a stale table digest"
            );
            ensure!(
                seq.num_groups() == self.kinds.len()
                    && seq.more().iter().all(|t| t.len() == seq.blocks.len())
                    && seq.null_block == self.null,
                "sequence {id} has tables of other shapes than its groups"
            );
            for (g, kind) in self.kinds.iter().enumerate() {
                let nulls = seq.nulls(g);
                // Nulls are only what the group skipped at some position up to `s`.
                ensure!(
                    nulls * bs <= kind.skipped_tokens(sched),
                    "sequence {id}: group {g} has {nulls} nulls at {sched} scheduled tokens"
                );
                for &b in &seq.table(g)[nulls..] {
                    ensure!(
                        (b as usize) < n && !self.is_null(b),
                        "sequence {id} holds block {b} out of range (group {g})"
                    );
                    refs[b as usize] += 1;
                    ensure!(
                        self.gpu.group_of(b) == g as u8,
                        "block {b} of group {g}'s table is the pool's group {}",
                        self.gpu.group_of(b)
                    );
                }
            }
        }
        if self.null {
            // The null block's one reference is the pool's own.
            refs[0] += 1;
        }

        // The stats tallies are the sums they stand for.
        let (mut reserved, mut used) = (0, 0);
        for (_, seq) in &guards {
            let (r, u) = seq.footprint(bs);
            reserved += r;
            used += u;
        }
        let stats = self.stats();
        ensure!(
            (stats.reserved_slots, stats.used_slots) == (reserved, used),
            "stats count {} reserved and {} used slots, the tables {reserved} and {used}",
            stats.reserved_slots,
            stats.used_slots
        );

        let indexed = self.gpu.audit(&refs)?;
        for (id, seq) in &guards {
            for g in 0..seq.num_groups() {
                for (i, &b) in seq.table(g).iter().enumerate() {
                    if indexed[b as usize] && !self.is_null(b) {
                        // Only blocks full of scheduled tokens and keyed are ever registered
                        // (or hit). Not the hold: a fork may register blocks shared with a
                        // held sequence past that sequence's own hold.
                        let full = (seq.scheduled / bs).min(seq.digests.len());
                        ensure!(
                            i < full,
                            "sequence {id} holds hashed block {b} at {i}, past its {full} \
                             scheduled, keyed full blocks"
                        );
                        let expected = seq.digests.get(i).map(|d| d.keyed(g as u8));
                        ensure!(
                        expected.is_some_and(|d| self.gpu.index_holds(b, &d)),
                        "block {b} is cached under another digest than sequence {id} expects at {i}"
                    );
                        ensure!(
                        self.gpu.index_tag_is(b, seq.tag(i)),
                        "block {b} is cached under another tag than sequence {id} expects at {i}"
                    );
                    }
                }
            }
        }
        // Each group's tallies count its blocks.
        for (g, t) in self.group_stats().iter().enumerate() {
            let count = |cached: bool| {
                (0..n as u32)
                    .filter(|&b| !self.is_null(b) && self.gpu.group_of(b) == g as u8)
                    .filter(|&b| {
                        let w = self.gpu.state(b).load();
                        if cached {
                            w.is_cached()
                        } else {
                            w.rc() > 0
                        }
                    })
                    .count()
            };
            let (used, cached) = (count(false), count(true));
            ensure!(
                (t.used_blocks, t.cached_blocks) == (used, cached),
                "group {g} tallies {} used and {} cached blocks, the pool {used} and {cached}",
                t.used_blocks,
                t.cached_blocks
            );
        }
        // Tenants: each present one's CACHED count is the pool's, and every CACHED block's
        // and live sequence's tenant is present.
        self.audit_tenants(guards.iter().map(|(_, seq)| seq.tenant()))?;
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
        m.gpu.state(0).share().unwrap();
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
        crate::sync::lock(&m.seqs.get(1).unwrap().seq).blocks[1] = 5;
        let msg = violation(&m);
        assert!(msg.contains("rc") || msg.contains("digest"), "{msg}");
    }
}
