//! Device duties returned by the call that makes them: the cached blocks a call evicted.
//!
//! An evicted block is handed to the evicting call's sequence at once, and that sequence's
//! next step writes it. A tier below the GPU must copy the old KV out before that step, so
//! the duty belongs to exactly the call that evicted the block, and to its caller. A global
//! log drained later would let one caller copy out a block that another caller's step has
//! already overwritten, and store that KV under the old digest.
//!
//! `capture(call)` runs `call` and returns, with its result, the `(block, group, digest)` of
//! every eviction made during it ON THIS THREAD. That is exactly the call's own evictions:
//! every public call of the managers runs wholly on its calling thread (no core call hands
//! work to another thread; the binding's GIL release runs the closure on the same thread),
//! and an eviction hands the block to the call that made it (`BlockPool::take_into`,
//! `GroupPool::take`). The pools report evictions through `record_eviction`, which keeps
//! them only while a capture is active on the thread (and the pool was built with
//! `record_evictions`): other threads' evictions never reach this capture, and a call made
//! without a capture costs one thread-local read per eviction.
//!
//! The evictions come back whatever the call returns: an error after an eviction (only a
//! `Broken` manager can have one: admission reserves every block before it takes any) still
//! reports the blocks, so their KV is never silently lost or misfiled.

use crate::hashing::Digest;
use std::cell::RefCell;

/// One eviction: the block, its group (0 without groups) and the digest it was cached under.
pub type Evicted = (u32, u8, Digest);

thread_local! {
    /// The evictions of the capture active on this thread, if any.
    static ACTIVE: RefCell<Option<Vec<Evicted>>> = const { RefCell::new(None) };
}

/// Run `call` and return its result with the evictions it made on this thread, oldest
/// first. Captures nest: an inner capture's evictions are also the outer one's.
pub fn capture<T>(call: impl FnOnce() -> T) -> (T, Vec<Evicted>) {
    /// Restores the outer capture even if `call` unwinds (its evictions then join the
    /// outer one's, as on a normal return).
    struct Restore(Option<Option<Vec<Evicted>>>);
    impl Restore {
        fn finish(&mut self) -> Vec<Evicted> {
            let outer = self.0.take().unwrap_or_default();
            ACTIVE.with(|a| {
                let mut a = a.borrow_mut();
                let mine = a.take().unwrap_or_default();
                *a = outer.map(|mut o| {
                    o.extend_from_slice(&mine);
                    o
                });
                mine
            })
        }
    }
    impl Drop for Restore {
        fn drop(&mut self) {
            if self.0.is_some() {
                self.finish();
            }
        }
    }
    let outer = ACTIVE.with(|a| a.borrow_mut().replace(Vec::new()));
    let mut restore = Restore(Some(outer));
    let out = call();
    let mine = restore.finish();
    (out, mine)
}

/// Whether a capture is active on this thread.
pub fn capturing() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}

/// Report one eviction to the capture active on this thread; without one, nothing.
pub fn record_eviction(block: u32, group: u8, digest: Digest) {
    ACTIVE.with(|a| {
        if let Some(v) = a.borrow_mut().as_mut() {
            v.push((block, group, digest));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(x: u8) -> Digest {
        Digest::from_words([u64::from(x); 4], 32)
    }

    #[test]
    fn a_capture_sees_only_its_own_thread_and_span() {
        record_eviction(1, 0, d(1)); // no capture: dropped
        let ((), got) = capture(|| {
            record_eviction(2, 0, d(2));
            std::thread::spawn(|| record_eviction(3, 0, d(3)))
                .join()
                .unwrap();
            let ((), other) = std::thread::spawn(|| capture(|| record_eviction(4, 1, d(4))))
                .join()
                .unwrap();
            assert_eq!(other, vec![(4, 1, d(4))]);
        });
        assert_eq!(got, vec![(2, 0, d(2))]);
        assert!(!capturing());
    }

    #[test]
    fn nested_captures_report_to_both() {
        let ((), outer) = capture(|| {
            record_eviction(1, 0, d(1));
            let ((), inner) = capture(|| record_eviction(2, 0, d(2)));
            assert_eq!(inner, vec![(2, 0, d(2))]);
        });
        assert_eq!(outer, vec![(1, 0, d(1)), (2, 0, d(2))]);
    }

    #[test]
    fn an_unwinding_call_leaves_no_capture_behind() {
        let caught = std::panic::catch_unwind(|| {
            capture(|| {
                record_eviction(1, 0, d(1));
                panic!("boom")
            })
        });
        assert!(caught.is_err());
        assert!(!capturing());
    }
}
