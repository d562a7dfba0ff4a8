//! The reset gate: every call that changes block ownership enters it shared, and
//! `reset_prefix_cache` enters it exclusive, so a reset sees no call half done and no call
//! sees half a reset. That makes reset linearizable against hits and allocations.
//!
//! Shared entries are spread over `SLOTS` cache-padded counters (each thread keeps to one),
//! so the common path is one uncontended read-modify-write, not a global reader count.
//! Entering shared: raise the slot, then check `writer`; entering exclusive: set `writer`,
//! then wait for every slot to drain. Both sides store, then issue a SeqCst fence, then load
//! (the store-buffering pattern): the two fences are totally ordered, so at least one side
//! sees the other's store, and a reader never proceeds while a writer believes it is alone.
//! Fences rather than SeqCst accesses, because loom models SeqCst fences exactly.

use crate::sync::{backoff, fence, AtomicBool, AtomicUsize, Mutex, Ordering};

const SLOTS: usize = 16;

#[repr(align(128))]
struct Slot(AtomicUsize);

pub struct Gate {
    /// Shared holders per slot; a thread enters and leaves through the same slot.
    slots: [Slot; SLOTS],
    /// True from the moment a writer announces itself until it leaves.
    writer: AtomicBool,
    /// Serialises writers (resets are rare and may simply queue).
    writers: Mutex<()>,
}

fn slot_index() -> usize {
    #[cfg(not(loom))]
    {
        use std::cell::Cell;
        use std::sync::atomic::{AtomicUsize as StdAtomic, Ordering as StdOrdering};
        static NEXT: StdAtomic = StdAtomic::new(0);
        thread_local!(static INDEX: Cell<usize> = const { Cell::new(usize::MAX) });
        INDEX.with(|i| {
            if i.get() == usize::MAX {
                // Relaxed: only spreads threads over slots; any value is correct.
                i.set(NEXT.fetch_add(1, StdOrdering::Relaxed) % SLOTS);
            }
            i.get()
        })
    }
    #[cfg(loom)]
    {
        // Two threads under a model: give them distinct slots (and slot 0 to the main
        // thread), so the model covers the cross-slot protocol.
        let id = format!("{:?}", loom::thread::current().id());
        let digits: String = id.chars().filter(char::is_ascii_digit).collect();
        digits.parse::<usize>().unwrap_or(0) % 2
    }
}

/// A shared entry; leaves the gate when dropped.
pub struct Shared<'a> {
    gate: &'a Gate,
    slot: usize,
}

impl Drop for Shared<'_> {
    fn drop(&mut self) {
        // Release: this call's changes happen before a writer that sees the slot drained.
        self.gate.slots[self.slot].0.fetch_sub(1, Ordering::Release);
    }
}

impl Gate {
    pub fn new() -> Self {
        Self {
            slots: std::array::from_fn(|_| Slot(AtomicUsize::new(0))),
            writer: AtomicBool::new(false),
            writers: Mutex::new(()),
        }
    }

    /// Enter shared, or `None` (nothing held) when a writer is in or entering and `wait` is
    /// false.
    pub fn try_shared(&self, wait: bool) -> Option<Shared<'_>> {
        let slot = slot_index();
        let mut spins = 0;
        loop {
            // Store, SeqCst fence, load: see the module docs. Acquire on the load pairs with
            // the writer's Release store when it leaves, so its changes are visible to us.
            self.slots[slot].0.fetch_add(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if !self.writer.load(Ordering::Acquire) {
                return Some(Shared { gate: self, slot });
            }
            self.slots[slot].0.fetch_sub(1, Ordering::Release);
            if !wait {
                return None;
            }
            // Relaxed: only a hint for when to try again; the loop re-checks after its fence.
            while self.writer.load(Ordering::Relaxed) {
                backoff(&mut spins);
            }
        }
    }

    /// Run `f` while no shared holder is inside.
    pub fn exclusive<T>(&self, f: impl FnOnce() -> T) -> T {
        let _one_writer = crate::sync::lock(&self.writers);
        // Store, SeqCst fence, loads: see the module docs. Acquire on the loads pairs with
        // each reader's Release decrement, so their changes are visible to the writer.
        self.writer.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let mut spins = 0;
        for slot in &self.slots {
            while slot.0.load(Ordering::Acquire) != 0 {
                backoff(&mut spins);
            }
        }
        let out = f();
        // Release: the writer's changes happen before the readers it lets in.
        self.writer.store(false, Ordering::Release);
        out
    }

    /// Whether a writer is in or entering (tests).
    #[cfg(all(test, not(loom)))]
    pub fn writer_active(&self) -> bool {
        self.writer.load(Ordering::SeqCst)
    }
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    #[test]
    fn exclusive_never_overlaps_shared() {
        let gate = Arc::new(Gate::new());
        let inside = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (gate, inside) = (gate.clone(), inside.clone());
                std::thread::spawn(move || {
                    for i in 0..20_000 {
                        if (i + t) % 97 == 0 {
                            gate.exclusive(|| {
                                assert_eq!(inside.load(Ordering::SeqCst), 0, "reader inside");
                                inside.store(1 << 32, Ordering::SeqCst);
                                std::hint::spin_loop();
                                inside.store(0, Ordering::SeqCst);
                            });
                        } else {
                            let _g = gate.try_shared(true).unwrap();
                            let v = inside.fetch_add(1, Ordering::SeqCst);
                            assert!(v < 1 << 32, "writer inside");
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert!(!gate.writer_active());
    }

    #[test]
    fn a_non_waiting_reader_backs_out_while_a_writer_is_in() {
        let gate = Gate::new();
        gate.exclusive(|| assert!(gate.try_shared(false).is_none()));
        let g = gate.try_shared(false);
        assert!(g.is_some());
    }
}
