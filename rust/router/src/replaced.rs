//! The holder sets snapshots replaced (`commit_snapshot_deferred`), queued until dropped, and
//! the drops of them in flight. A writer short of slots drops what is queued itself, or, when
//! another thread has already taken the queue and is clearing it, waits for that drop to end:
//! the slots it needs are about to come free, so refusing (`TooManyHolders`) would be wrong.

use crate::sync::{Condvar, Mutex, MutexGuard};

pub(crate) struct Replaced<T> {
    /// The queue and the count of drops in flight, changed together so that a waiter never
    /// sees a set in neither (taken off the queue but not counted).
    state: Mutex<State<T>>,
    /// Notified when a drop in flight ends (`Taken` dropped) or a set is queued.
    ended: Condvar,
}

struct State<T> {
    /// Replaced sets not yet taken by a drop: bits still set, slots still taken.
    queue: Vec<T>,
    /// Drops that took sets off the queue and have not yet ended: their slots come free when
    /// they end.
    in_flight: usize,
    /// Drops ended since the start: a writer whose slot allocation failed before a drop
    /// ended tries again rather than refuse (its failure may predate the freed slots).
    ended: u64,
}

/// Sets taken off the queue to drop; while it lives, a drop is in flight.
pub(crate) struct Taken<'a, T> {
    owner: &'a Replaced<T>,
    /// The sets to drop (empty: nothing was queued, and no drop was counted).
    pub(crate) sets: Vec<T>,
    counted: bool,
}

impl<T> Drop for Taken<'_, T> {
    fn drop(&mut self) {
        if self.counted {
            let mut st = self.owner.lock();
            st.in_flight -= 1;
            // Wrapping: only equality with a reading taken moments before is ever asked.
            st.ended = st.ended.wrapping_add(1);
            drop(st);
            self.owner.ended.notify_all();
        }
    }
}

impl<T> Replaced<T> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                queue: Vec::new(),
                in_flight: 0,
                ended: 0,
            }),
            ended: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push(&self, set: T) {
        self.lock().queue.push(set);
        // A writer waiting for a drop in flight can take this one at once.
        self.ended.notify_all();
    }

    /// Take every queued set; the drop counts as in flight until the answer is dropped.
    pub(crate) fn take(&self) -> Taken<'_, T> {
        let mut st = self.lock();
        let sets = std::mem::take(&mut st.queue);
        let counted = !sets.is_empty();
        if counted {
            st.in_flight += 1;
        }
        Taken {
            owner: self,
            sets,
            counted,
        }
    }

    /// How many drops have ended: read before trying to allocate, passed to `reclaim`.
    pub(crate) fn ended(&self) -> u64 {
        self.lock().ended
    }

    /// For a writer whose slot allocation failed after `ended()` said `seen`: the queued sets
    /// to drop now (`Some`, possibly after waiting for drops in flight to end: then empty,
    /// and the slots they held are free; also empty when a drop ended since `seen`: try
    /// again), or `None` when nothing is queued, in flight or newly freed (the slots are
    /// really taken).
    pub(crate) fn reclaim(&self, seen: u64) -> Option<Taken<'_, T>> {
        let mut st = self.lock();
        if st.queue.is_empty() && st.in_flight == 0 && st.ended == seen {
            return None;
        }
        while st.queue.is_empty() && st.in_flight > 0 {
            st = self.ended.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        drop(st);
        Some(self.take())
    }

    /// Allocate with `alloc`; while it fails, drop the replaced sets `reclaim` hands over
    /// (`drop_sets`, which ends the drop by dropping the `Taken`) and try again. Refuses, with
    /// `alloc`'s error, only when nothing is queued, in flight or freed since the failure.
    /// `RouterIndex::alloc_slot` is this with the slot allocator; the loom model
    /// (`loom_models/replaced.rs`) runs it as it is.
    pub(crate) fn alloc_with<S, E>(
        &self,
        mut alloc: impl FnMut() -> Result<S, E>,
        mut drop_sets: impl FnMut(Taken<'_, T>),
    ) -> Result<S, E> {
        loop {
            // Read before the attempt: a drop that ends after it counts as news to `reclaim`.
            let seen = self.ended();
            match alloc() {
                Ok(s) => return Ok(s),
                Err(err) => match self.reclaim(seen) {
                    Some(taken) => drop_sets(taken),
                    None => return Err(err),
                },
            }
        }
    }

    /// Wait until no drop is in flight, then look at the queued sets (for a full check, when
    /// nothing else is applying).
    pub(crate) fn with_settled<R>(&self, f: impl FnOnce(&[T]) -> R) -> R {
        let mut st = self.lock();
        while st.in_flight > 0 {
            st = self.ended.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        f(&st.queue)
    }

    /// Look at the queued sets as they are (drops in flight not waited for).
    pub(crate) fn with_queued<R>(&self, f: impl FnOnce(&[T]) -> R) -> R {
        f(&self.lock().queue)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Replaced;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn nothing_queued_or_in_flight_reclaims_nothing() {
        let r = Replaced::<u32>::new();
        assert!(r.reclaim(r.ended()).is_none());
        assert!(r.take().sets.is_empty());
        // An empty take counts no drop: a reclaim still has nothing to wait for.
        let t = r.take();
        assert!(r.reclaim(r.ended()).is_none());
        drop(t);
    }

    /// The race CI hit second: a writer's allocation fails, then another thread's drop ends
    /// (slots freed, nothing queued or in flight) before the writer looks. It must try again.
    #[test]
    fn a_drop_ended_since_the_failure_means_try_again() {
        let r = Replaced::new();
        r.push(1u32);
        let seen = r.ended();
        drop(r.take());
        let t = r.reclaim(seen).expect("a drop ended since");
        assert!(t.sets.is_empty());
        drop(t);
        assert!(r.reclaim(r.ended()).is_none());
    }

    /// The count of ended drops at its limit: the drop that wraps it is still news to a
    /// writer that read the limit before its attempt (no overflow panic, no refusal).
    #[test]
    fn the_ended_count_wraps_and_still_means_try_again() {
        let r = Replaced::new();
        r.lock().ended = u64::MAX;
        r.push(1u32);
        let seen = r.ended();
        assert_eq!(seen, u64::MAX);
        drop(r.take());
        assert_eq!(r.ended(), 0, "wrapped past the limit");
        let t = r.reclaim(seen).expect("a drop ended since the reading");
        assert!(t.sets.is_empty());
        drop(t);
        assert!(r.reclaim(r.ended()).is_none());
        assert_eq!(r.lock().in_flight, 0);
    }

    #[test]
    fn reclaim_takes_what_is_queued() {
        let r = Replaced::new();
        r.push(1u32);
        r.push(2);
        let t = r.reclaim(r.ended()).expect("queued sets");
        assert_eq!(t.sets, vec![1, 2]);
        drop(t);
        assert!(r.reclaim(r.ended()).is_none());
    }

    /// The race CI once hit: one thread has taken the queue and is still dropping it when a
    /// writer short of slots looks. The writer must wait for that drop, not give up.
    #[test]
    fn reclaim_waits_for_a_drop_in_flight() {
        let r = Replaced::new();
        r.push(7u32);
        let ended = AtomicBool::new(false);
        std::thread::scope(|s| {
            let taken = r.take();
            assert_eq!(taken.sets, vec![7]);
            let waiter = s.spawn(|| {
                let t = r.reclaim(r.ended()).expect("a drop was in flight");
                // It returned only once the drop had ended, with nothing left to drop.
                assert!(
                    ended.load(Ordering::SeqCst),
                    "returned before the drop ended"
                );
                assert!(t.sets.is_empty());
            });
            std::thread::sleep(Duration::from_millis(50));
            ended.store(true, Ordering::SeqCst);
            drop(taken);
            waiter.join().unwrap();
        });
        assert!(r.reclaim(r.ended()).is_none());
    }

    /// A set queued while a writer waits for a drop in flight is handed to it at once.
    #[test]
    fn a_set_queued_during_the_wait_is_taken() {
        let r = Replaced::new();
        r.push(1u32);
        std::thread::scope(|s| {
            let taken = r.take();
            let waiter = s.spawn(|| r.reclaim(r.ended()).expect("in flight").sets.clone());
            std::thread::sleep(Duration::from_millis(20));
            r.push(2);
            // The waiter wakes on the push (or the end of the drop) and takes 2.
            drop(taken);
            assert_eq!(waiter.join().unwrap(), vec![2]);
        });
    }

    #[test]
    fn settled_waits_for_drops_in_flight() {
        let r = Replaced::new();
        r.push(1u32);
        let ended = AtomicBool::new(false);
        std::thread::scope(|s| {
            let taken = r.take();
            let checker = s.spawn(|| {
                r.with_settled(|q| {
                    assert!(ended.load(Ordering::SeqCst));
                    q.len()
                })
            });
            std::thread::sleep(Duration::from_millis(30));
            ended.store(true, Ordering::SeqCst);
            drop(taken);
            assert_eq!(checker.join().unwrap(), 0);
        });
        r.push(3);
        assert_eq!(r.with_queued(|q| q.to_vec()), vec![3]);
    }
}
