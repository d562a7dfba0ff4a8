//! `fork` and `free` with groups: shares and withdrawals over every table.

use crate::block_pool::refcount_overflow;
use crate::counters;
use crate::error::Result;
use crate::manager::BlockManager;
use crate::sequence::Sequence;

impl BlockManager {
    /// Withdraw from the cache, group by group and tail first, the entries past the first `c`
    /// tokens that `seq` registered (not hits).
    pub(crate) fn retract_grouped(&self, seq: &Sequence, c: usize) {
        let from = (c / self.block_size()).max(seq.hit_blocks);
        for g in 0..seq.num_groups() {
            for i in (from..self.registrable(seq)).rev() {
                let b = seq.table(g)[i];
                if !self.is_null(b) && self.gpu.retract(b, &seq.digests[i].keyed(g as u8), false) {
                    counters::add(&self.counters.unregistered_blocks, 1);
                }
            }
        }
    }

    /// `fork` with groups: one more holder of every non-null entry of every table; on a
    /// refcount overflow the shares taken so far are given back.
    pub(crate) fn share_all(&self, seq: &Sequence) -> Result<()> {
        let held: Vec<u32> = self.held_entries(seq).collect();
        for (k, &b) in held.iter().enumerate() {
            if self.gpu.state(b).share().is_err() {
                for &back in held[..k].iter().rev() {
                    // The parent still holds each: this only lowers the count back.
                    self.gpu.release(back, None)?;
                }
                return Err(refcount_overflow(b));
            }
        }
        Ok(())
    }
}
