//! One atomic word per GPU block: refcount, hashed flag and generation.
//!
//! Layout of the word (`u64`):
//! - bits 0..20: `rc`, the number of sequence tables that hold the block, at most `RC_MAX`;
//!   every increment is checked first, so the count never carries into the flag;
//! - bit 20: `HASHED`, the block is registered in the prefix index under its digest;
//! - bit 21: `PINNED`, the block is never evicted (`pin`): set and cleared only while the
//!   block is OWNED, by a holder, so it is constant through every CACHED period; cleared when
//!   the block becomes FREE or is claimed;
//! - bits 22..64: `gen`, a 42-bit generation bumped each time the block becomes CACHED and
//!   each time a CACHED block is claimed (evicted or reset). An LRU record names the
//!   generation it was written for; it is live only while the block is CACHED with that
//!   generation.
//!
//! Why 43 bits cannot wrap into a false match: a stale record leaves the LRU queue at the
//! latest at its next compaction, which runs once the queue holds more than
//! `2 * num_blocks + 64` records (`lru_queue`). Between a record's push and its removal the
//! queue takes at most `bound + num_blocks` pushes (one per release to CACHED), and each
//! claim of the block follows one of those releases, so the block's generation advances by
//! less than `2 * (3 * 2^31 + 64) + 2 < 2^34` while the record exists: far below `2^42`.
//! `tests::generation_wraps_inside_its_bits` checks the field at its limit.
//!
//! The states of the contract: FREE = `rc == 0 && !HASHED`, OWNED = `rc >= 1`,
//! CACHED = `rc == 0 && HASHED`. Every transition is one compare-and-swap or read-modify-write.

use crate::sync::{AtomicU64, Ordering};

const RC_BITS: u32 = 20;
const RC_MASK: u64 = (1 << RC_BITS) - 1;
/// The most tables that may hold one block.
pub const RC_MAX: u32 = RC_MASK as u32;
const HASHED: u64 = 1 << RC_BITS;
const PINNED: u64 = 1 << (RC_BITS + 1);
const GEN_SHIFT: u32 = RC_BITS + 2;
/// Generations live in `0..=GEN_MAX` and wrap to 0.
#[cfg(all(test, not(loom)))]
pub const GEN_MAX: u64 = u64::MAX >> GEN_SHIFT;

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
    pub fn pinned(self) -> bool {
        self.0 & PINNED != 0
    }
    pub fn generation(self) -> u64 {
        self.0 >> GEN_SHIFT
    }
    pub fn is_free(self) -> bool {
        self.rc() == 0 && !self.hashed()
    }
    pub fn is_cached(self) -> bool {
        self.rc() == 0 && self.hashed()
    }
    fn with_rc(self, rc: u32) -> Self {
        debug_assert!(rc <= RC_MAX);
        Self((self.0 & !RC_MASK) | u64::from(rc))
    }
    /// The same flags and rc with the next generation (wrapping inside its 42 bits: the
    /// shift drops the carry).
    fn next_generation(self) -> Self {
        let low = self.0 & (RC_MASK | HASHED | PINNED);
        Self(low | (self.generation().wrapping_add(1) << GEN_SHIFT))
    }
}

/// What dropping one reference did to the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Other tables still hold it.
    StillOwned,
    /// Last reference, unhashed: the caller pushes it on the free stack.
    ToFree,
    /// Last reference, hashed: the caller queues `(block, generation)` in the LRU, unless
    /// the block is `pinned` (never evicted: it is kept out of the eviction order, and its
    /// unit out of `available`).
    ToCached { generation: u64, pinned: bool },
}

/// What a prefix hit found when it tried to take a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Referenced; `revived` when it was CACHED; `unit` when that consumed the caller's unit
    /// of `available` (a pinned CACHED block has none counted, so reviving it takes none).
    Pinned { revived: bool, unit: bool },
    /// The block is not hashed (any more): the index entry was stale.
    Stale,
    /// It is CACHED and the caller holds no unit of `available` for it.
    NeedsUnit,
    /// It already has `RC_MAX` holders.
    Full,
}

/// `share` refused: the block already has `RC_MAX` holders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcFull;

/// The state word of one block (invariant: see the module docs).
pub struct BlockState(AtomicU64);

impl BlockState {
    pub fn new_free() -> Self {
        Self(AtomicU64::new(0))
    }

    /// A word with the given fields, for tests at the limits of each field.
    #[cfg(all(test, not(loom)))]
    pub fn from_parts(rc: u32, hashed: bool, generation: u64) -> Self {
        let word = u64::from(rc) | if hashed { HASHED } else { 0 } | generation << GEN_SHIFT;
        Self(AtomicU64::new(word))
    }

    /// Relaxed: a snapshot for audits, statistics and admission estimates, never for a
    /// decision that a later compare-and-swap does not re-check.
    pub fn load(&self) -> Word {
        Word(self.0.load(Ordering::Relaxed))
    }

    /// FREE or just-claimed -> OWNED(1), by the thread that popped it from the free stack or
    /// claimed it from the LRU: no other thread may change an unhashed rc-0 word, so a plain
    /// increment is exact. Relaxed: the pop or the claim already gave the acquire edge.
    pub fn take(&self) {
        let old = Word(self.0.fetch_add(1, Ordering::Relaxed));
        debug_assert!(old.is_free(), "took a block that was not free: {old:?}");
    }

    /// OWNED -> OWNED(rc + 1), for a caller that already holds a reference (fork); refused
    /// at `RC_MAX` holders. Relaxed, as for `Arc::clone`: the caller's reference keeps the
    /// block alive.
    pub fn share(&self) -> Result<(), RcFull> {
        self.0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                (Word(w).rc() < RC_MAX).then(|| w + 1)
            })
            .map(|_| ())
            .map_err(|_| RcFull)
    }

    /// Take a reference to a hashed block found through the index (the caller then checks
    /// the block's digest: see `prefix_index`).
    /// `have_unit`: the caller reserved one unit of `available` in case the block is CACHED.
    pub fn pin(&self, have_unit: bool) -> Pin {
        // Acquire: pairs with the releasing decrement so the block is seen fully released.
        let mut cur = Word(self.0.load(Ordering::Acquire));
        loop {
            if !cur.hashed() {
                return Pin::Stale;
            }
            if cur.rc() == RC_MAX {
                return Pin::Full;
            }
            let revived = cur.rc() == 0;
            let unit = revived && !cur.pinned();
            if unit && !have_unit {
                return Pin::NeedsUnit;
            }
            match self.0.compare_exchange_weak(
                cur.0,
                cur.with_rc(cur.rc() + 1).0,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => return Pin::Pinned { revived, unit },
                Err(actual) => cur = Word(actual),
            }
        }
    }

    /// Drop one reference, or `None` if the block has none (a corrupted caller: the word is
    /// left as it was). Release, as for `Arc::drop`: this table's use of the block happens
    /// before whoever takes it next; the last dropper also acquires (AcqRel) so it sees
    /// every earlier dropper's use before it hands the block on.
    pub fn release(&self) -> Option<Released> {
        // Relaxed: only a guess for the CAS below.
        let mut cur = Word(self.0.load(Ordering::Relaxed));
        loop {
            let next = match cur.rc() {
                0 => return None,
                1 if cur.hashed() => cur.with_rc(0).next_generation(),
                // FREE: a pin does not outlive the block's content.
                1 => Word(cur.0 & !PINNED).with_rc(0),
                rc => cur.with_rc(rc - 1),
            };
            match self
                .0
                .compare_exchange_weak(cur.0, next.0, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) if next.rc() > 0 => return Some(Released::StillOwned),
                Ok(_) if next.hashed() => {
                    return Some(Released::ToCached {
                        generation: next.generation(),
                        pinned: next.pinned(),
                    })
                }
                Ok(_) => return Some(Released::ToFree),
                Err(actual) => cur = Word(actual),
            }
        }
    }

    /// Mark an OWNED block hashed before its index entry is published. Release: a thread that
    /// pins it (an Acquire CAS) sees the digest stored before this.
    pub fn set_hashed(&self) {
        self.0.fetch_or(HASHED, Ordering::Release);
    }

    /// Undo `set_hashed` when the index had no room (nobody could reach the block through
    /// the index in between). Relaxed: only the owner looks at the flag meanwhile.
    pub fn clear_hashed(&self) {
        self.0.fetch_and(!HASHED, Ordering::Relaxed);
    }

    /// OWNED(1) and hashed -> OWNED(1) unhashed, for the sole holder that withdraws the
    /// block from the prefix cache (a retraction: its KV was never computed, or the holder
    /// will write into it). Refused (false) when another table holds it too or it is not
    /// hashed. A racing hit either pins first (then rc is 2 and this refuses) or finds the
    /// flag clear (`Pin::Stale`). AcqRel on success: the clear is ordered after the pins it
    /// beat (their CAS failed on this word) and before the caller removes the index entry.
    pub fn unhash_if_sole(&self) -> bool {
        self.unhash_if(|rc| rc == 1)
    }

    /// OWNED and hashed -> the same rc, unhashed, for a holder that withdraws a block whose
    /// KV was never written: the other holders keep their reference to an ordinary block
    /// (FREE, not CACHED, after the last release). Refused (false) when it is not hashed.
    /// Ordering as for `unhash_if_sole`; a hit that pinned first keeps its reference.
    pub fn unhash_held(&self) -> bool {
        self.unhash_if(|rc| rc >= 1)
    }

    fn unhash_if(&self, holders_ok: impl Fn(u32) -> bool) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |w| {
                let cur = Word(w);
                (holders_ok(cur.rc()) && cur.hashed()).then_some(w & !HASHED)
            })
            .is_ok()
    }

    /// OWNED -> the same, pinned (`on`) or not: by a holder, so never during a CACHED
    /// period. Refused (false) when the block has no holder (a caller bug). Release on
    /// success, so the flag travels with the holder's later release to whoever makes the
    /// block CACHED (its AcqRel release reads this write's value).
    pub fn set_pinned(&self, on: bool) -> bool {
        self.0
            .fetch_update(Ordering::Release, Ordering::Relaxed, |w| {
                let cur = Word(w);
                (cur.rc() >= 1).then_some(if on { w | PINNED } else { w & !PINNED })
            })
            .is_ok()
    }

    /// CACHED with this `generation` -> unhashed and unpinned, next generation, with `rc` set to `rc`:
    /// 1 when an evictor claims it for an allocation, 0 when reset moves it to the free stack.
    /// Acquire on success: the claimer sees the last owner's use of the block as finished.
    pub fn claim_cached(&self, generation: u64, rc: u32) -> bool {
        // Relaxed: only a guess for the CAS, which re-checks the whole word.
        let cur = Word(self.0.load(Ordering::Relaxed));
        if !cur.is_cached() || cur.generation() != generation {
            return false;
        }
        let next = Word(cur.0 & !(HASHED | PINNED))
            .next_generation()
            .with_rc(rc);
        self.0
            .compare_exchange(cur.0, next.0, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn cached_generation(r: Option<Released>) -> u64 {
        match r {
            Some(Released::ToCached { generation, .. }) => generation,
            other => panic!("a hashed block's last release must cache it, got {other:?}"),
        }
    }

    #[test]
    fn only_the_sole_holder_unhashes() {
        let s = BlockState::new_free();
        s.take();
        assert!(
            !s.unhash_if_sole(),
            "an unhashed block has nothing to withdraw"
        );
        s.set_hashed();
        s.share().unwrap();
        assert!(!s.unhash_if_sole(), "another table holds it");
        assert_eq!(s.release(), Some(Released::StillOwned));
        assert!(s.unhash_if_sole());
        assert_eq!(s.pin(true), Pin::Stale, "a withdrawn block cannot be hit");
        assert_eq!(s.release(), Some(Released::ToFree));
    }

    #[test]
    fn a_held_block_is_unhashed_whatever_its_holders() {
        let s = BlockState::new_free();
        s.take();
        assert!(
            !s.unhash_held(),
            "an unhashed block has nothing to withdraw"
        );
        s.set_hashed();
        s.share().unwrap();
        assert!(s.unhash_held());
        assert_eq!(s.load().rc(), 2, "the holders keep their references");
        assert_eq!(s.pin(true), Pin::Stale);
        assert_eq!(s.release(), Some(Released::StillOwned));
        assert_eq!(s.release(), Some(Released::ToFree), "freed, not cached");
    }

    #[test]
    fn lifecycle_free_owned_cached_evicted() {
        let s = BlockState::new_free();
        assert!(s.load().is_free());
        s.take();
        assert_eq!(s.load().rc(), 1);
        s.set_hashed();
        s.share().unwrap();
        assert_eq!(s.release(), Some(Released::StillOwned));
        let first = cached_generation(s.release());
        assert!(s.load().is_cached());
        // A hit needs a unit of `available` to revive a cached block.
        assert_eq!(s.pin(false), Pin::NeedsUnit);
        assert_eq!(
            s.pin(true),
            Pin::Pinned {
                revived: true,
                unit: true
            }
        );
        assert_eq!(
            s.pin(false),
            Pin::Pinned {
                revived: false,
                unit: false
            }
        );
        assert!(!s.claim_cached(first, 1), "owned blocks cannot be claimed");
        s.release();
        let newer = cached_generation(s.release());
        assert_ne!(newer, first);
        assert!(!s.claim_cached(first, 1), "an older LRU record is stale");
        assert!(s.claim_cached(newer, 1));
        assert_eq!(s.load().rc(), 1);
        assert!(!s.load().hashed());
        assert_eq!(
            s.pin(true),
            Pin::Stale,
            "an unhashed block cannot be pinned"
        );
        assert_eq!(s.load().generation(), newer + 1);
        assert_eq!(s.release(), Some(Released::ToFree));
        assert_eq!(s.release(), None, "a FREE block has no reference to drop");
        assert!(s.load().is_free());
    }

    #[test]
    fn clear_hashed_makes_release_free() {
        let s = BlockState::new_free();
        s.take();
        s.set_hashed();
        s.clear_hashed();
        assert_eq!(s.release(), Some(Released::ToFree));
    }

    #[test]
    fn refcount_stops_at_its_limit_without_touching_the_flags() {
        let s = BlockState::from_parts(RC_MAX - 1, true, 7);
        assert_eq!(s.share(), Ok(()));
        assert_eq!(s.load().rc(), RC_MAX);
        assert_eq!(
            s.share(),
            Err(RcFull),
            "the RC_MAX + 1-th holder is refused"
        );
        assert_eq!(s.pin(true), Pin::Full, "so is a prefix hit");
        let w = s.load();
        assert_eq!((w.rc(), w.hashed(), w.generation()), (RC_MAX, true, 7));
        assert_eq!(s.release(), Some(Released::StillOwned));
        assert_eq!(
            s.pin(false),
            Pin::Pinned {
                revived: false,
                unit: false
            }
        );
    }

    #[test]
    fn generation_wraps_inside_its_bits() {
        // One below the top: the release to CACHED reaches GEN_MAX, the claim wraps to 0.
        let s = BlockState::from_parts(1, true, GEN_MAX - 1);
        assert_eq!(cached_generation(s.release()), GEN_MAX);
        assert!(s.load().is_cached());
        assert!(s.claim_cached(GEN_MAX, 1));
        let w = s.load();
        assert_eq!((w.rc(), w.hashed(), w.generation()), (1, false, 0));
        assert_eq!(s.release(), Some(Released::ToFree));
        assert!(s.load().is_free());
    }

    #[test]
    fn the_pin_bit_survives_its_neighbours_limits() {
        // The generation wraps past GEN_MAX right above the pin bit, and rc reaches RC_MAX
        // right below HASHED: neither carries into PINNED or clears it.
        let s = BlockState::from_parts(1, true, GEN_MAX);
        assert!(s.set_pinned(true));
        assert_eq!(
            s.release(),
            Some(Released::ToCached {
                generation: 0,
                pinned: true
            })
        );
        // A pinned CACHED block is revived without a unit.
        assert_eq!(
            s.pin(false),
            Pin::Pinned {
                revived: true,
                unit: false
            }
        );
        let full = BlockState::from_parts(RC_MAX - 1, true, GEN_MAX);
        assert!(full.set_pinned(true));
        full.share().unwrap();
        assert!(full.share().is_err(), "rc at RC_MAX");
        let w = full.load();
        assert_eq!(
            (w.rc(), w.hashed(), w.pinned(), w.generation()),
            (RC_MAX, true, true, GEN_MAX)
        );
        // Released CACHED, then claimed: the claim clears the pin with the hash.
        assert_eq!(cached_generation(s.release()), 1);
        assert!(s.load().pinned());
        assert!(s.claim_cached(1, 1));
        let w = s.load();
        assert_eq!(
            (w.rc(), w.hashed(), w.pinned(), w.generation()),
            (1, false, false, 2)
        );
        // A pinned unhashed block loses the pin when it becomes FREE; a block with no
        // holder cannot be pinned.
        assert!(s.set_pinned(true));
        assert_eq!(s.release(), Some(Released::ToFree));
        assert!(s.load().is_free() && !s.load().pinned());
        assert!(!s.set_pinned(true));
    }

    #[test]
    fn a_hot_block_never_revives_an_old_record() {
        // The defect of an 11-bit stamp: after 2,048 releases an old record matched again.
        let s = BlockState::new_free();
        s.take();
        s.set_hashed();
        let first = cached_generation(s.release());
        for _ in 0..5000 {
            assert!(matches!(s.pin(true), Pin::Pinned { .. }));
            assert_ne!(cached_generation(s.release()), first);
            assert!(!s.claim_cached(first, 1));
        }
        assert!(s.load().is_cached());
    }
}
