//! `check_invariants` of the hybrid manager: the lifecycle contract over one pool and
//! every group's tables (docs/semantics.md, "KV-cache groups").

use super::manager::GroupManager;
use super::pool::NULL;
use crate::error::{ensure_invariant, Result};

impl GroupManager {
    pub fn check_invariants(&self) -> Result<()> {
        self.broken.guarded(false, || {
            let st = self.lock()?;
            let bs = self.block_size();
            let n = st.pool.num_blocks();
            let mut holders = vec![0u32; n];
            let mut group_of = vec![u8::MAX; n];
            for (&id, seq) in &st.seqs {
                ensure_invariant!(seq.scheduled <= seq.tokens.len(), "sequence {id}: s > n");
                ensure_invariant!(
                    seq.hit_blocks * bs <= seq.scheduled,
                    "sequence {id}: h*B > s"
                );
                if self.config.enable_prefix_caching {
                    ensure_invariant!(
                        seq.digests.len() == seq.tokens.len() / bs,
                        "sequence {id}: {} digests for {} tokens",
                        seq.digests.len(),
                        seq.tokens.len()
                    );
                }
                if seq.cpu.is_some() {
                    ensure_invariant!(seq.tables.is_empty(), "sequence {id}: swapped with tables");
                    continue;
                }
                ensure_invariant!(
                    seq.tables.len() == self.kinds.len(),
                    "sequence {id}: tables"
                );
                let len = seq.len();
                ensure_invariant!(len * bs >= seq.scheduled, "sequence {id}: tables too short");
                for (g, table) in seq.tables.iter().enumerate() {
                    ensure_invariant!(
                        table.len() == len,
                        "sequence {id}: group {g} length differs"
                    );
                    let nulls = seq.nulls(g);
                    // Nulls are only what the group skipped at some position up to `s`.
                    ensure_invariant!(
                        nulls * bs <= self.kinds[g].skipped_tokens(seq.scheduled),
                        "sequence {id}: group {g} has {nulls} nulls at {} scheduled tokens",
                        seq.scheduled
                    );
                    for (i, &b) in table.iter().enumerate().skip(nulls) {
                        ensure_invariant!(
                            b != NULL && (b as usize) < n,
                            "sequence {id}: entry {i}"
                        );
                        holders[b as usize] += 1;
                        ensure_invariant!(
                            group_of[b as usize] == u8::MAX || group_of[b as usize] == g as u8,
                            "block {b} in tables of two groups"
                        );
                        group_of[b as usize] = g as u8;
                        if let Some((kg, kd)) = st.pool.key(b) {
                            ensure_invariant!(
                                i < seq.registrable(bs)
                                    && kg == g as u8
                                    && kd == seq.digests[i]
                                    && st.pool.pool.index_tag_is(b, seq.tag(i)),
                                "sequence {id}: group {g} entry {i} (block {b}) hashed wrongly"
                            );
                        }
                    }
                }
            }
            // The pool's own audit: states, free stack, LRU, index and counters against the
            // holders (the null block's one reference is the pool's own).
            holders[NULL as usize] = 1;
            st.pool.pool.audit(&holders)?;
            for (b, &g) in group_of.iter().enumerate().skip(1) {
                let w = st.pool.pool.state(b as u32).load();
                if w.rc() > 0 || w.is_cached() {
                    ensure_invariant!(
                        g == u8::MAX || g == st.pool.group_of(b as u32),
                        "block {b}: its tables' group is not the pool's"
                    );
                }
            }
            for (g, t) in st.pool.tallies().iter().enumerate() {
                let count = |cached: bool| {
                    (1..n)
                        .filter(|&b| {
                            let w = st.pool.pool.state(b as u32).load();
                            let held = if cached { w.is_cached() } else { w.rc() > 0 };
                            held && st.pool.group_of(b as u32) == g as u8
                        })
                        .count()
                };
                let (used, cached) = (count(false), count(true));
                ensure_invariant!(t.used == used, "group {g}: used tally {} != {used}", t.used);
                ensure_invariant!(
                    t.cached == cached,
                    "group {g}: cached tally {} != {cached}",
                    t.cached
                );
            }
            let cpu_held: usize = st
                .seqs
                .values()
                .filter_map(|s| s.cpu.as_ref())
                .map(|c| {
                    c.iter()
                        .flatten()
                        .filter(|&&x| x != super::table::SWAPPED_NULL)
                        .count()
                })
                .sum();
            ensure_invariant!(
                cpu_held + st.cpu_free.len() == self.config.num_cpu_blocks as usize,
                "CPU blocks lost"
            );
            Ok(())
        })
    }
}
