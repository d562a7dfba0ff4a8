//! The swap space's events, per copy: `BlockStored(medium="CPU")` when the first CPU copy of
//! a block's key (its group and digest) appears, `BlockRemoved(medium="CPU")` when the last
//! one goes (docs/events.md). Two swapped-out sequences with one prompt hold two CPU copies
//! of each of its blocks; announcing each copy's removal would tell a router the key is gone
//! from the CPU while the other copy still holds it.

use crate::events::{KvEvent, Medium};
use crate::manager::BlockManager;
use crate::sequence::Sequence;
use crate::sync::{lock, Mutex};
use std::collections::HashMap;

/// How many swapped-out sequences hold a CPU copy of each key, while events are on: one
/// entry per key some swapped sequence holds (removed with its last copy). Its lock is taken
/// under a sequence's lock (and a swap-in's prefix lock), and the event queue's under it;
/// only swaps and frees of swapped sequences take it.
#[derive(Default)]
pub(crate) struct CpuCopies(Mutex<HashMap<([u64; 4], u8), u32>>);

impl BlockManager {
    /// `swap_out`'s events: `BlockStored(CPU)` for each full scheduled block the swapped
    /// sequence `seq` now holds on the CPU (group by group, in order) whose key had no copy.
    pub(crate) fn cpu_copies_stored(&self, seq: &Sequence) {
        if self.gpu.event_log().is_none() {
            return;
        }
        let mut copies = lock(&self.cpu_copies.0);
        self.for_each_cpu_copy(seq, |g, i| {
            let n = copies.entry((seq.digests[i].words(), g as u8)).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.gpu
                    .push_event(|| self.stored_event_of(seq, g, i, Medium::Cpu));
            }
        });
    }

    /// The events of `seq`'s CPU copies going (swap-in, free), before or after its CPU
    /// table is dropped: `BlockRemoved(CPU)` for each key whose last copy this was.
    pub(crate) fn cpu_copies_removed(&self, seq: &Sequence) {
        if self.gpu.event_log().is_none() {
            return;
        }
        let mut copies = lock(&self.cpu_copies.0);
        let mut gone = |g: usize, i: usize| {
            let key = (seq.digests[i].words(), g as u8);
            match copies.get_mut(&key) {
                Some(n) if *n > 1 => *n -= 1,
                // The last copy (or, defensively, one never counted): announce its removal.
                _ => {
                    copies.remove(&key);
                    self.gpu.push_event(|| KvEvent::BlockRemoved {
                        block_hash: seq.digests[i],
                        medium: Medium::Cpu,
                        group: g as u8,
                    });
                }
            }
        };
        if self.plain() {
            // The plain paths drop the CPU table first: every registrable block had a copy.
            (0..self.registrable(seq)).for_each(|i| gone(0, i));
        } else {
            self.for_each_cpu_copy(seq, gone);
        }
    }
}
