//! The free set: a lock-free LIFO stack of block ids (Treiber, with an ABA tag).
//!
//! LIFO because the most recently freed block is the warmest in the GPU's L2 and the host's
//! caches, and because vLLM reuses unhashed freed blocks in that order: it puts each call's
//! at the head of its free queue, so the last call's blocks go first, and within a call in
//! the order it freed them (a request's tail first). `release_table` pushes a call's blocks
//! head first with `push_all`, so its tail ends on top.

use crate::alloc::try_boxed;
use crate::error::Result;
use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering, Padded};

const EMPTY: u32 = u32::MAX;

fn pack(tag: u32, top: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(top)
}

fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

pub struct FreeStack {
    /// `(tag << 32) | top`. `top` is the id on top or `EMPTY`; `tag` grows with every
    /// successful push or pop, so a pop that read an old `(tag, top)` fails its CAS even if
    /// `top` came back (ABA). A false success needs 2^32 successful operations between one
    /// thread's load and its CAS.
    head: Padded<AtomicU64>,
    /// `next[b]` is the id below `b` while `b` is on the stack; meaningless otherwise.
    /// Atomic because a popper may read `next[b]` while another thread re-pushes `b`
    /// (its CAS then fails, but a plain read would be a data race).
    next: Box<[AtomicU32]>,
    /// Number of ids on the stack. Raised before a push and lowered after a pop (so it never
    /// underflows), exact only when no call is in flight; used for statistics and audits,
    /// never for admission, hence Relaxed everywhere.
    len: Padded<AtomicUsize>,
}

impl FreeStack {
    /// A stack holding `0..n`, popping `0` first.
    pub fn full(n: u32) -> Result<Self> {
        let next = try_boxed(
            n as usize,
            |b| {
                AtomicU32::new(if b + 1 < n as usize {
                    b as u32 + 1
                } else {
                    EMPTY
                })
            },
            "the free stack",
        )?;
        let top = if n == 0 { EMPTY } else { 0 };
        Ok(Self {
            head: Padded(AtomicU64::new(pack(0, top))),
            next,
            len: Padded(AtomicUsize::new(n as usize)),
        })
    }

    pub fn pop(&self) -> Option<u32> {
        // Acquire: pairs with the Release push of the id we take, so the pusher's last use
        // of the block and its `next` store happen before ours.
        let mut cur = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(cur);
            if top == EMPTY {
                return None;
            }
            // Relaxed: ordered after the pusher's store by the Acquire load of `head`; if the
            // id was popped and re-pushed meanwhile, the tag makes the CAS below fail.
            let below = self.next[top as usize].load(Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), below),
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    return Some(top);
                }
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn push(&self, id: u32) {
        self.len.fetch_add(1, Ordering::Relaxed);
        let mut cur = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(cur);
            // Relaxed: published by the Release CAS below.
            self.next[id as usize].store(top, Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), id),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Push `ids` in order (the last ends on top) with one CAS: the chain is linked while
    /// no other thread can reach it, then published whole.
    pub fn push_all(&self, ids: &[u32]) {
        let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
            return;
        };
        self.len.fetch_add(ids.len(), Ordering::Relaxed);
        for pair in ids.windows(2) {
            // Relaxed: published by the Release CAS below, like `push`'s store.
            self.next[pair[1] as usize].store(pair[0], Ordering::Relaxed);
        }
        let mut cur = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(cur);
            // Relaxed: published by the Release CAS below.
            self.next[first as usize].store(top, Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                cur,
                pack(tag.wrapping_add(1), last),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// The ids from top to bottom. Exact only when no push or pop is in flight (audits);
    /// stops after `limit` ids so that a racing caller cannot loop forever.
    pub fn snapshot(&self, limit: usize) -> Vec<u32> {
        // Acquire pairs with the last push's Release; the Relaxed `next` loads are ordered
        // after it. Racing pushes or pops make the walk inexact, never unsafe.
        let (_, mut top) = unpack(self.head.load(Ordering::Acquire));
        let mut out = Vec::new();
        while top != EMPTY && out.len() < limit {
            out.push(top);
            top = self.next[top as usize].load(Ordering::Relaxed);
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pops_in_order_then_lifo() {
        let s = FreeStack::full(3).unwrap();
        assert_eq!(s.snapshot(10), vec![0, 1, 2]);
        assert_eq!(s.pop(), Some(0));
        assert_eq!(s.pop(), Some(1));
        s.push(0);
        assert_eq!(s.pop(), Some(0));
        assert_eq!(s.pop(), Some(2));
        assert_eq!(s.pop(), None);
        assert_eq!(s.len(), 0);
        assert!(FreeStack::full(0).unwrap().pop().is_none());
    }

    #[test]
    fn push_all_is_pushes_in_order() {
        let a = FreeStack::full(6).unwrap();
        let b = FreeStack::full(6).unwrap();
        for s in [&a, &b] {
            for _ in 0..5 {
                s.pop().unwrap();
            }
        }
        for id in [3, 0, 4] {
            a.push(id);
        }
        b.push_all(&[3, 0, 4]);
        b.push_all(&[]);
        assert_eq!(a.snapshot(10), b.snapshot(10));
        assert_eq!(b.snapshot(10), vec![4, 0, 3, 5]);
        assert_eq!(b.len(), 4);
    }

    #[test]
    fn threads_never_lose_or_duplicate_ids() {
        let s = std::sync::Arc::new(FreeStack::full(64).unwrap());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut held = Vec::new();
                        for _ in 0..3 {
                            if let Some(id) = s.pop() {
                                held.push(id);
                            }
                        }
                        if held.len() == 3 {
                            s.push_all(&held);
                        } else {
                            held.into_iter().for_each(|id| s.push(id));
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let mut ids = s.snapshot(1000);
        ids.sort_unstable();
        assert_eq!(ids, (0..64).collect::<Vec<_>>());
        assert_eq!(s.len(), 64);
    }
}
