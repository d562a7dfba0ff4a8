//! `truncate`: dropping a sequence's tokens past a point (rejected drafts, rollbacks).

use crate::counters;
use crate::error::{invalid, Error, Result};
use crate::manager::{cdiv, BlockManager};

impl BlockManager {
    /// Drop every token past `m` and the table entries past them (their blocks are released
    /// tail first; hashed ones stay cached). A block the roll-back leaves partial that was
    /// full (`cuts_a_full_block`) is the next one written, so it must end exclusively this
    /// sequence's and unhashed: hashed and held alone, it is withdrawn from the cache;
    /// shared (hashed or not), it is copied, or another holder full there could register it
    /// and this sequence's next write would land in a cached block. Returns the
    /// copy-on-write pairs, or `None` when a needed copy does not fit (nothing changed).
    pub fn truncate(&self, id: u64, m: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            let n = seq.tokens.len();
            if m == 0 || m > n {
                return Err(invalid(format!(
                    "num_tokens {m} for sequence {id} must be in 1..={n}"
                )));
            }
            if !self.plain() {
                return self.truncate_grouped(id, seq, m);
            }
            let bs = self.block_size();
            let last = m / bs;
            let partial = cuts_a_full_block(n, m, bs)
                .then(|| seq.blocks.get(last).copied())
                .flatten();
            // A hashed partial block was full: its digest is `digests[last]`. Withdrawing it
            // (held alone) is the only change before the copy's reservation, and then no copy
            // follows. Not withdrawn, it is copied if shared, or if still hashed (defence: a
            // hashed block another table does not hold was not withdrawn only if the state is
            // broken). Unhashed, its refcount only falls under this sequence's lock (no hit
            // finds it; a fork of another holder raises it only while `rc > 1`).
            let copy = match partial {
                Some(b) => {
                    let withdrawn = self.gpu.state(b).load().hashed()
                        && seq
                            .digests
                            .get(last)
                            .is_some_and(|d| self.gpu.retract(b, d, true));
                    let w = self.gpu.state(b).load();
                    if !withdrawn && (w.rc() > 1 || w.hashed()) {
                        if !self.gpu.reserve(1) {
                            return Ok(None);
                        }
                        Some(b)
                    } else {
                        None
                    }
                }
                None => None,
            };
            let keep = cdiv(m, bs).min(seq.blocks.len());
            self.retain(seq, keep, seq.blocks.len() - keep);
            let dropped = seq.truncate_blocks(keep);
            self.release_blocks(&dropped, seq.digests.get(keep..).unwrap_or_default())?;
            counters::add(&self.counters.truncated_blocks, dropped.len());
            let mut pairs = Vec::new();
            if let Some(src) = copy {
                let dst = self.gpu.take();
                pairs.push((src, dst));
                seq.replace_block(last, dst);
                self.release_copied(src, seq.digests.get(last))?;
                counters::add(&self.counters.cow_copies, 1);
            }
            seq.tokens.truncate(m);
            seq.digests.truncate(seq.digests.len().min(last));
            seq.tags.truncate(seq.tags.len().min(last));
            seq.scheduled = seq.scheduled.min(m);
            seq.hit_blocks = seq.hit_blocks.min(last);
            seq.clamp_hold(last);
            Ok(Some(pairs))
        })
    }
}

/// Whether rolling `n` tokens back to `m` leaves partial a block that was full of tokens
/// (block `m / bs`). Its other holders (forks, hits) then hold it full, so one of them may
/// register it. A roll-back inside a block that was already partial changes nothing there:
/// every holder of a shared block holds the same tokens in it (a write into a shared block
/// copies it first), so none is full there.
pub(crate) fn cuts_a_full_block(n: usize, m: usize, bs: usize) -> bool {
    m % bs != 0 && n >= (m / bs + 1) * bs
}
