//! The one place that names the atomics and locks, so that loom can replace them.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// A value alone on its cache lines. 128 bytes, not 64: x86 prefetches lines in adjacent
/// pairs, so neighbours 64 bytes apart still contend. Hot shared words (counts every call
/// changes, locks different threads take) are padded so that writing one does not evict the
/// read-mostly fields next to it from other cores' caches.
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Ask the CPU to bring the cache lines of `*value` in, without waiting for them. Batch calls
/// issue these for every item before the first locked instruction: a compare-and-swap waits
/// for its line and holds back the loads behind it, so the misses of a cold batch would
/// otherwise be paid one after another instead of together.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    // Every line the value touches: from the one holding its first byte, whatever its
    // offset in that line, to the one holding its last.
    let start = (value as *const T).cast::<u8>();
    let first_line_offset = start as usize % 64;
    for offset in (0..first_line_offset + std::mem::size_of::<T>()).step_by(64) {
        prefetch_ptr(start.wrapping_sub(first_line_offset).wrapping_add(offset));
    }
}

/// `prefetch` of the one line holding `at`, which need not point at anything valid (the
/// free room past a vector's end, say).
#[inline]
pub(crate) fn prefetch_ptr<T>(at: *const T) {
    #[cfg(all(target_arch = "x86_64", not(loom)))]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint: it never faults, whatever the address, and neither
        // reads into the program nor writes; SSE is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>()) };
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom))))]
    let _ = at;
}

/// Locks, ignoring poisoning: every critical section in the core leaves its data consistent
/// before any call that could panic, so a poisoned lock holds valid data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Spin briefly, then yield, while waiting for another thread to finish a transition.
#[cfg(not(loom))]
pub(crate) fn backoff(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Under loom every wait must yield, so the model lets the awaited thread run.
#[cfg(loom)]
pub(crate) fn backoff(_spins: &mut u32) {
    loom::thread::yield_now();
}

/// Tries to lock without blocking; `None` when another holder has it (or this thread does).
pub(crate) fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

#[cfg(not(loom))]
thread_local! {
    /// True inside `nonblocking`: a call that would wait for a lock returns
    /// `Error::WouldBlock` instead, having changed nothing.
    static NONBLOCKING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with every lock wait of the manager's calls turned into `Error::WouldBlock`.
/// The Python binding calls each single-sequence method this way with the GIL held, and
/// again in blocking mode with the GIL released only if it would block: no thread then waits
/// for a lock while it holds the GIL.
#[cfg(not(loom))]
pub fn nonblocking<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            NONBLOCKING.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(NONBLOCKING.with(|c| c.replace(true)));
    f()
}

/// Whether lock waits must fail with `Error::WouldBlock` (see `nonblocking`).
#[cfg(not(loom))]
pub(crate) fn may_wait() -> bool {
    !NONBLOCKING.with(std::cell::Cell::get)
}

#[cfg(loom)]
pub(crate) fn may_wait() -> bool {
    true
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn padded_values_own_their_lines() {
        struct Two {
            a: Padded<AtomicU64>,
            b: Padded<AtomicU64>,
        }
        let two = Two {
            a: Padded(AtomicU64::new(1)),
            b: Padded(AtomicU64::new(2)),
        };
        let (a, b) = (&*two.a as *const _ as usize, &*two.b as *const _ as usize);
        assert_eq!(std::mem::align_of::<Padded<AtomicU64>>(), 128);
        assert_eq!((a % 128, b % 128), (0, 0));
        assert!(a.abs_diff(b) >= 128);
        assert_eq!(
            two.a.load(Ordering::Relaxed) + two.b.load(Ordering::Relaxed),
            3
        );
    }
}
