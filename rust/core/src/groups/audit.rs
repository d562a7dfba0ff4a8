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
                        if let Some(k) = st.pool.key(b) {
                            ensure_invariant!(
                                i < seq.registrable(bs)
                                    && k.group == g as u8
                                    && k.digest == seq.digests[i],
                                "sequence {id}: group {g} entry {i} (block {b}) hashed wrongly"
                            );
                        }
                    }
                }
            }
            let cached = st.pool.cached_in_order();
            ensure_invariant!(cached.len() == st.pool.num_cached(), "LRU list length");
            let mut state = vec![0u8; n];
            for &b in st.pool.free_list() {
                ensure_invariant!(b != NULL && state[b as usize] == 0, "free block {b} twice");
                state[b as usize] = 1;
                ensure_invariant!(st.pool.key(b).is_none(), "free block {b} is hashed");
            }
            for &b in &cached {
                ensure_invariant!(state[b as usize] == 0, "cached block {b} also elsewhere");
                state[b as usize] = 2;
                ensure_invariant!(st.pool.key(b).is_some(), "cached block {b} not hashed");
            }
            let mut hashed = 0;
            for b in 1..n {
                let rc = st.pool.rc(b as u32);
                ensure_invariant!(
                    rc == holders[b],
                    "block {b}: rc {rc} but {} table entries",
                    holders[b]
                );
                ensure_invariant!(
                    (rc > 0) != (state[b] != 0),
                    "block {b} is owned and free or cached, or none of them"
                );
                if let Some(k) = st.pool.key(b as u32) {
                    hashed += 1;
                    ensure_invariant!(
                        st.pool.find(k.group, &k.digest, k.tag) == Some(b as u32),
                        "block {b} hashed but not in the index"
                    );
                    ensure_invariant!(st.pool.group_of(b as u32) == k.group, "block {b}: group");
                }
            }
            ensure_invariant!(hashed == st.pool.index_len(), "index holds strays");
            ensure_invariant!(
                st.pool.rc(NULL) == 0 && state[0] == 0,
                "the null block was used"
            );
            for (g, t) in st.pool.tally.iter().enumerate() {
                let used = (1..n)
                    .filter(|&b| st.pool.rc(b as u32) > 0 && st.pool.group_of(b as u32) == g as u8)
                    .count();
                ensure_invariant!(t.used == used, "group {g}: used tally {} != {used}", t.used);
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
