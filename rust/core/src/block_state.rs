//! One atomic word per GPU block: refcount, hashed flag, release stamp and epoch.
//!
//! Layout of the word (`u64`):
//! - bits 0..20: `rc`, the number of sequence tables that hold the block;
//! - bit 20: `HASHED`, the block is registered in the prefix index under its digest;
//! - bits 21..32: `stamp`, bumped each time the block becomes CACHED, so that an LRU entry
//!   written at an earlier release is recognised as stale (wrapping is harmless: a stale entry
//!   that matches after a wrap only evicts a block that is CACHED anyway, slightly out of order);
//! - bits 32..64: `epoch`, bumped each time a hashed block is evicted (or dropped by reset),
//!   so that an LRU record written for an earlier incarnation is recognised as stale.
//!
//! The states of the contract: FREE = `rc == 0 && !HASHED`, OWNED = `rc >= 1`,
//! CACHED = `rc == 0 && HASHED`. Every transition is one compare-and-swap or read-modify-write.

use crate::sync::{AtomicU64, Ordering};

const RC_BITS: u32 = 20;
const RC_MASK: u64 = (1 << RC_BITS) - 1;
const HASHED: u64 = 1 << RC_BITS;
const STAMP_SHIFT: u32 = 21;
const STAMP_MASK: u64 = ((1 << 11) - 1) << STAMP_SHIFT;
const EPOCH_SHIFT: u32 = 32;

/// A decoded state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Word(u64);

impl Word {
    pub fn rc(self) -> u32 {
        (self.0 & RC_MASK) as u32
    }
    pub fn hashed(self) -> bool {
        self.0 & HASHED != 0
    }
    pub fn stamp(self) -> u32 {
        ((self.0 & STAMP_MASK) >> STAMP_SHIFT) as u32
    }
    pub fn epoch(self) -> u32 {
        (self.0 >> EPOCH_SHIFT) as u32
    }
    pub fn is_free(self) -> bool {
        self.rc() == 0 && !self.hashed()
    }
    pub fn is_cached(self) -> bool {
        self.rc() == 0 && self.hashed()
    }
    fn with_rc(self, rc: u32) -> Self {
        Self((self.0 & !RC_MASK) | u64::from(rc))
    }
    fn next_stamp(self) -> Self {
        let stamp = (u64::from(self.stamp()) + 1) << STAMP_SHIFT & STAMP_MASK;
        Self((self.0 & !STAMP_MASK) | stamp)
    }
    fn unhashed_next_epoch(self) -> Self {
        let epoch = u64::from(self.epoch().wrapping_add(1)) << EPOCH_SHIFT;
        Self((self.0 & (RC_MASK | STAMP_MASK)) | epoch)
    }
}

/// What dropping one reference did to the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Other tables still hold it.
    StillOwned,
    /// Last reference, unhashed: the caller pushes it on the free stack.
    ToFree,
    /// Last reference, hashed: the caller queues `(block, epoch, stamp)` in the LRU.
    ToCached { epoch: u32, stamp: u32 },
}

/// What a prefix hit found when it tried to take a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Referenced; `revived` when it was CACHED (one unit of `available` consumed).
    Pinned { revived: bool },
    /// The block is not hashed (any more): the index entry was stale.
    Stale,
    /// It is CACHED and the caller holds no unit of `available` for it.
    NeedsUnit,
}

/// The state word of one block (invariant: see the module docs).
pub struct BlockState(AtomicU64);

impl BlockState {
    pub fn new_free() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Relaxed: a snapshot for audits, statistics and admission estimates, never for a
    /// decision that a later compare-and-swap does not re-check.
    pub fn load(&self) -> Word {
        Word(self.0.load(Ordering::Relaxed))
    }

    /// FREE or just-evicted -> OWNED(1), by the thread that popped it from the free stack or
    /// claimed it from the LRU: no other thread may change an unhashed rc-0 word, so a plain
    /// increment is exact. Relaxed: the pop or the claim already gave the acquire edge.
    pub fn take(&self) {
        let old = Word(self.0.fetch_add(1, Ordering::Relaxed));
        debug_assert!(old.is_free(), "took a block that was not free: {old:?}");
    }

    /// OWNED -> OWNED(rc + 1), for a caller that already holds a reference (fork).
    /// Relaxed, as for `Arc::clone`: the caller's reference keeps the block alive.
    pub fn share(&self) {
        let old = Word(self.0.fetch_add(1, Ordering::Relaxed));
        assert!(
            old.rc() >= 1 && old.rc() < RC_MASK as u32,
            "share of {old:?}"
        );
    }

    /// Take a reference to a hashed block found through the index (the caller then checks
    /// the block's digest: see `prefix_index`).
    /// `have_unit`: the caller reserved one unit of `available` in case the block is CACHED.
    pub fn pin(&self, have_unit: bool) -> Pin {
        // Acquire on success: the hit reads nothing the previous owner wrote on the host, but
        // the acquire pairs with the releasing decrement so the block is seen fully released.
        let mut cur = Word(self.0.load(Ordering::Acquire));
        loop {
            if !cur.hashed() {
                return Pin::Stale;
            }
            let revived = cur.rc() == 0;
            if revived && !have_unit {
                return Pin::NeedsUnit;
            }
            match self.0.compare_exchange_weak(
                cur.0,
                cur.with_rc(cur.rc() + 1).0,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Pin::Pinned { revived },
                Err(actual) => cur = Word(actual),
            }
        }
    }

    /// Drop one reference. Release, as for `Arc::drop`: this table's use of the block happens
    /// before whoever takes it next; the last dropper also acquires (AcqRel) so it sees every
    /// earlier dropper's use before it hands the block on.
    pub fn release(&self) -> Released {
        // Relaxed: only a guess for the CAS below.
        let mut cur = Word(self.0.load(Ordering::Relaxed));
        loop {
            assert!(cur.rc() >= 1, "release of an unreferenced block: {cur:?}");
            let next = if cur.rc() > 1 {
                cur.with_rc(cur.rc() - 1)
            } else if cur.hashed() {
                cur.with_rc(0).next_stamp()
            } else {
                cur.with_rc(0)
            };
            match self
                .0
                .compare_exchange_weak(cur.0, next.0, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) if next.rc() > 0 => return Released::StillOwned,
                Ok(_) if next.hashed() => {
                    return Released::ToCached {
                        epoch: next.epoch(),
                        stamp: next.stamp(),
                    }
                }
                Ok(_) => return Released::ToFree,
                Err(actual) => cur = Word(actual),
            }
        }
    }

    /// Mark an OWNED block hashed before its index entry is published. Release: a thread that
    /// pins it (an Acquire CAS) sees the digest stored before this.
    pub fn set_hashed(&self) {
        self.0.fetch_or(HASHED, Ordering::Release);
    }

    /// Undo `set_hashed` when the index already held the digest (nobody could reach the block
    /// through the index in between). Relaxed: only the owner looks at the flag meanwhile.
    pub fn clear_hashed(&self) {
        self.0.fetch_and(!HASHED, Ordering::Relaxed);
    }

    /// CACHED with this `(epoch, stamp)` -> unhashed, next epoch, with `rc` set to `rc`:
    /// 1 when an evictor claims it for an allocation, 0 when reset moves it to the free stack.
    /// Acquire on success: the claimer sees the last owner's use of the block as finished.
    pub fn claim_cached(&self, epoch: u32, stamp: u32, rc: u32) -> bool {
        // Relaxed: only a guess for the CAS, which re-checks the whole word.
        let cur = Word(self.0.load(Ordering::Relaxed));
        if !cur.is_cached() || cur.epoch() != epoch || cur.stamp() != stamp {
            return false;
        }
        let next = cur.unhashed_next_epoch().with_rc(rc);
        self.0
            .compare_exchange(cur.0, next.0, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_free_owned_cached_evicted() {
        let s = BlockState::new_free();
        assert!(s.load().is_free());
        s.take();
        assert_eq!(s.load().rc(), 1);
        let epoch = s.load().epoch();
        s.set_hashed();
        s.share();
        assert_eq!(s.release(), Released::StillOwned);
        let Released::ToCached { epoch: e, stamp } = s.release() else {
            panic!("hashed block must become cached")
        };
        assert_eq!(e, epoch);
        assert!(s.load().is_cached());
        // A hit needs a unit of `available` to revive a cached block.
        assert_eq!(s.pin(false), Pin::NeedsUnit);
        assert_eq!(s.pin(true), Pin::Pinned { revived: true });
        assert_eq!(s.pin(false), Pin::Pinned { revived: false });
        assert!(
            !s.claim_cached(epoch, stamp, 1),
            "owned blocks cannot be claimed"
        );
        s.release();
        let Released::ToCached { stamp: newer, .. } = s.release() else {
            panic!()
        };
        assert!(
            !s.claim_cached(epoch, stamp, 1),
            "an older LRU entry is stale"
        );
        assert!(s.claim_cached(epoch, newer, 1));
        assert_eq!(s.load().rc(), 1);
        assert!(!s.load().hashed());
        assert_eq!(
            s.pin(true),
            Pin::Stale,
            "an unhashed block cannot be pinned"
        );
        assert_eq!(s.load().epoch(), epoch.wrapping_add(1));
        assert_eq!(s.release(), Released::ToFree);
    }

    #[test]
    fn clear_hashed_makes_release_free() {
        let s = BlockState::new_free();
        s.take();
        s.set_hashed();
        s.clear_hashed();
        assert_eq!(s.release(), Released::ToFree);
    }

    #[test]
    fn stamp_wraps_inside_its_bits() {
        let s = BlockState::new_free();
        s.take();
        s.set_hashed();
        let epoch = s.load().epoch();
        assert!(matches!(s.release(), Released::ToCached { .. }));
        for _ in 0..5000 {
            assert!(matches!(s.pin(true), Pin::Pinned { .. }));
            assert!(matches!(s.release(), Released::ToCached { .. }));
        }
        assert_eq!(s.load().epoch(), epoch);
        assert!(s.load().is_cached());
    }
}
