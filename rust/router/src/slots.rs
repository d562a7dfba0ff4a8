//! Holder slots. A holder is one engine's blocks in one medium and group; it owns a slot, a
//! bit position in every block's holder bitmap (slot = 64 x word + bit). Slots make an
//! engine's removal, or its `AllBlocksCleared`, visible to lookups at once: its bit leaves
//! the word's `live` mask in one atomic step, and the blocks' bits are cleared afterwards.
//!
//! A retired slot may be reused by another holder while a lookup that saw the old one live
//! is still reading bits. So each word has a generation, bumped on every retirement in it
//! before any of the retired slot's bits change; a lookup reads it before and after a word
//! and reads the word again when it moved (a seqlock whose writers are retirements only:
//! stores and removals of live holders never make a lookup retry).

use crate::error::RouterError;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering};

pub(crate) struct Slots {
    /// Per word, bit b set: slot 64w+b belongs to a live holder, whose blocks lookups count.
    /// Set (Release) after the slot's `meta` is written; cleared (AcqRel) before its bits
    /// are. A slot staged for a snapshot is allocated but not live.
    live: Box<[AtomicU64]>,
    /// Per word: bumped (AcqRel) by every retirement of a live slot in the word, after the
    /// slot left `live` and before any of its bits change (module docs).
    gens: Box<[AtomicU64]>,
    /// Per slot: `engine handle << 32 | medium << 16 | group`. Written (Release) while the
    /// slot is not live, so after any retirement of its previous holder; read (Acquire) by
    /// lookups before they check the generation: a lookup that reads a new holder's meta
    /// then reads the generation its retirement bumped.
    meta: Box<[AtomicU64]>,
    /// Words that ever held an allocated slot: lookups read words `0..words`. Only grows
    /// (Release, with the first slot of the word allocated; Acquire by lookups).
    words: AtomicUsize,
    /// Free slots and the next never-used one; taken when holders come and go, never by lookups.
    alloc: Mutex<Alloc>,
    /// The most slots in use at once (`Config::max_holders`).
    limit: usize,
}

#[derive(Default)]
struct Alloc {
    free: Vec<u32>,
    next: u32,
    in_use: usize,
}

#[inline]
pub(crate) fn word_bit(slot: u32) -> (usize, u64) {
    ((slot / 64) as usize, 1u64 << (slot % 64))
}

pub(crate) fn pack_meta(engine: u32, medium: u16, group: u16) -> u64 {
    (u64::from(engine) << 32) | (u64::from(medium) << 16) | u64::from(group)
}

pub(crate) fn unpack_meta(m: u64) -> (u32, u16, u16) {
    ((m >> 32) as u32, (m >> 16) as u16, m as u16)
}

impl Slots {
    pub fn new(max_holders: usize) -> Self {
        let words = max_holders.div_ceil(64).max(1);
        Self {
            live: (0..words).map(|_| AtomicU64::new(0)).collect(),
            gens: (0..words).map(|_| AtomicU64::new(0)).collect(),
            meta: (0..words * 64).map(|_| AtomicU64::new(0)).collect(),
            words: AtomicUsize::new(0),
            alloc: Mutex::new(Alloc::default()),
            limit: max_holders,
        }
    }

    /// A slot for a new holder, not yet live.
    pub fn alloc(&self, meta: u64) -> Result<u32, RouterError> {
        let mut a = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        if a.in_use >= self.limit {
            return Err(RouterError::TooManyHolders(self.limit));
        }
        // in_use < limit <= meta.len(): a free slot or a never-used one exists.
        let slot = match a.free.pop() {
            Some(s) => s,
            None => {
                a.next += 1;
                a.next - 1
            }
        };
        a.in_use += 1;
        self.meta[slot as usize].store(meta, Ordering::Release);
        let (w, _) = word_bit(slot);
        // Under `alloc`'s lock: `words` only grows.
        if self.words.load(Ordering::Relaxed) <= w {
            self.words.store(w + 1, Ordering::Release);
        }
        Ok(slot)
    }

    /// Lookups count the slot's blocks from now on. Release: a lookup that sees the bit
    /// (Acquire) sees the slot's `meta`.
    pub fn set_live(&self, slot: u32) {
        let (w, b) = word_bit(slot);
        self.live[w].fetch_or(b, Ordering::Release);
    }

    /// Lookups stop counting the slot; those in flight that counted it will read its word
    /// again. Call before clearing any of its bits.
    pub fn retire(&self, slot: u32) {
        let (w, b) = word_bit(slot);
        // AcqRel, both: the generation moves after the bit left `live` (a lookup that reads
        // the new generation then reads `live` without the bit), and before the bits change
        // (a lookup that reads a changed bit, Acquire, then reads the new generation).
        self.live[w].fetch_and(!b, Ordering::AcqRel);
        self.gens[w].fetch_add(1, Ordering::AcqRel);
    }

    /// A commit's swap: lookups stop counting the `old` slots, then count the `new` ones. Old
    /// out before new in, so a lookup that reads a word once never counts an old holder
    /// together with its replacement (a lookup that reads two words may: `lookup.rs`).
    pub fn replace_live(
        &self,
        old: impl IntoIterator<Item = u32>,
        new: impl IntoIterator<Item = u32>,
    ) {
        for s in old {
            self.retire(s);
        }
        for s in new {
            self.set_live(s);
        }
    }

    /// Give a slot back once its bits are all clear (after `retire`, or never live).
    pub fn free(&self, slot: u32) {
        let mut a = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        a.free.push(slot);
        a.in_use -= 1;
    }

    pub fn in_use(&self) -> usize {
        self.alloc.lock().unwrap_or_else(|e| e.into_inner()).in_use
    }

    pub fn words(&self) -> usize {
        self.words.load(Ordering::Acquire)
    }

    pub fn gen(&self, w: usize) -> u64 {
        self.gens[w].load(Ordering::Acquire)
    }

    pub fn live(&self, w: usize) -> u64 {
        self.live[w].load(Ordering::Acquire)
    }

    pub fn meta(&self, slot: u32) -> u64 {
        self.meta[slot as usize].load(Ordering::Acquire)
    }

    pub fn bytes(&self) -> usize {
        (self.live.len() + self.gens.len() + self.meta.len()) * 8
    }
}
