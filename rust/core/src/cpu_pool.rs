//! The CPU swap space: block ids `0..num_cpu_blocks`, each FREE or held by exactly one
//! swapped-out sequence. No prefix caching there, so no refcounts: a free stack and a count.

use crate::error::Result;
use crate::free_stack::FreeStack;
use crate::sync::{AtomicUsize, Ordering};

pub struct CpuPool {
    /// Exactly the FREE CPU blocks (at quiescence).
    free: FreeStack,
    /// FREE CPU blocks not promised to a swap-out; raised only after the push.
    available: AtomicUsize,
    num_blocks: usize,
}

impl CpuPool {
    pub fn new(num_blocks: u32) -> Result<Self> {
        Ok(Self {
            free: FreeStack::full(num_blocks)?,
            available: AtomicUsize::new(num_blocks as usize),
            num_blocks: num_blocks as usize,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// `k` blocks, all or none.
    pub fn take(&self, k: usize) -> Option<Vec<u32>> {
        // Acquire on success: pairs with `give_back`'s Release increment, so the pushes it
        // counted are visible to the pops below.
        self.available
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |a| a.checked_sub(k))
            .ok()?;
        let mut spins = 0;
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            match self.free.pop() {
                Some(b) => out.push(b),
                // Counted but not yet pushed by a racing release: wait for it.
                None => crate::sync::backoff(&mut spins),
            }
        }
        Some(out)
    }

    /// Give blocks back, last first (a sequence releases tail first).
    pub fn give_back(&self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            self.free.push(b);
        }
        // Release: see `take`.
        self.available.fetch_add(blocks.len(), Ordering::Release);
    }

    pub fn free_snapshot(&self) -> Vec<u32> {
        self.free.snapshot(self.num_blocks + 1)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn takes_all_or_nothing_and_gives_back_tail_first() {
        let p = CpuPool::new(3).unwrap();
        assert_eq!(p.take(2), Some(vec![0, 1]));
        assert_eq!(p.take(2), None, "only one left");
        assert_eq!(p.num_free(), 1);
        p.give_back(&[0, 1]);
        // Tail first: 1 is pushed before 0, so 0 is on top.
        assert_eq!(p.take(3), Some(vec![0, 1, 2]));
        assert_eq!(p.num_free(), 0);
    }
}
