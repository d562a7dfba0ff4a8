//! Tenant ids: one per cache salt in use (id `UNSALTED` for none), each with its counters.
//!
//! A salted tenant stays while it has something: a live sequence or a call in flight (its
//! `refs`), a CACHED block (`cached`), or a quota. Its held blocks are its sequences' (a
//! prefix hit needs the same salt), so they need no count of their own. When the last of
//! those goes, the tenant leaves (its salt, counters and quota are forgotten) and its id is
//! free for another salt: before issue 32 every salt ever seen stayed (about 175 bytes each).
//!
//! Id reuse is safe because every place that names a tenant id holds one of the things that
//! keep it: a sequence (and the call that creates it, from before its first hit) holds a
//! ref; a hashed block's id in the pool is written by a holder and is read only while the
//! block is OWNED by the tenant's sequences or CACHED (then counted in `cached`); a policy
//! member is CACHED, or held by a sequence (a member whose block went FREE while held is
//! rewritten before its tenant is read again: `quotas`). Whoever brings `refs` or `cached`
//! to zero checks, under the registry's lock, whether both are zero and no quota is set, and
//! removes the tenant then. New refs are taken under that lock (or by a holder of one, a
//! fork), and `cached` rises only by a holder, so a tenant seen with nothing under the lock
//! has nothing until its removal; of two that reach zero at once, the second to take the
//! lock sees both zeros.
//!
//! The counters live in `Slots`, readable without the lock (the pool's CACHED transitions and
//! the prefix tallies touch them on the hot path); the salts, quotas and order of entry live
//! under the lock, which every call holds briefly.

use super::{Quota, UNSALTED};
use crate::sync::{lock, AtomicU64, AtomicUsize, Mutex, Ordering};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, OnceLock};

/// One id's counters.
#[derive(Default)]
pub struct Slot {
    /// Live sequences of the tenant, and calls in flight for it (module docs). AcqRel
    /// decrements, Acquire reads under the lock: a holder's `cached` changes before its
    /// release are seen by whoever finds zero.
    refs: AtomicUsize,
    /// Its CACHED blocks, pinned ones included: exact at quiescence. Relaxed (the refs'
    /// edge and the lock order what removal needs).
    cached: AtomicUsize,
    /// Prompt tokens looked up by its successful allocations, and of those the ones found
    /// cached. Relaxed: tallies.
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
}

/// The first segment's size; segment `k` holds `BASE << k` ids (loom: few atomics).
const BASE: usize = if cfg!(loom) { 2 } else { 64 };
/// Enough segments for every `u32` id.
const SEGMENTS: usize = 33;

/// Counters by id, growing by segments (never moved, so readable without a lock): as many
/// as the most tenants present at once, since ids are reused lowest first.
struct Slots {
    segments: [OnceLock<Box<[Slot]>>; SEGMENTS],
}

impl Slots {
    fn place(id: u32) -> (usize, usize) {
        let x = id as usize / BASE + 1;
        let k = (usize::BITS - 1 - x.leading_zeros()) as usize;
        (k, id as usize - BASE * ((1 << k) - 1))
    }

    /// The slot of an id that exists (made by `make`).
    fn get(&self, id: u32) -> &Slot {
        let (k, i) = Self::place(id);
        &self.segments[k].get().expect("a tenant id that exists")[i]
    }

    /// The slot of `id`, its segment made if needed (under the registry's lock).
    fn make(&self, id: u32) -> &Slot {
        let (k, i) = Self::place(id);
        &self.segments[k].get_or_init(|| (0..BASE << k).map(|_| Slot::default()).collect())[i]
    }

    fn bytes(&self) -> usize {
        self.segments
            .iter()
            .filter_map(OnceLock::get)
            .map(|s| s.len() * size_of::<Slot>())
            .sum()
    }
}

struct Record {
    /// None for `UNSALTED`.
    salt: Option<Arc<[u8]>>,
    quota: Quota,
    /// When it entered the registry: `rows` lists tenants in this order.
    order: u64,
}

struct Inner {
    /// Salt -> id, for every salted tenant present.
    ids: HashMap<Arc<[u8]>, u32>,
    /// By id; `None`: a free id.
    records: Vec<Option<Record>>,
    /// Free ids, lowest first (so the tail empties and shrinks); an id freed with the tail
    /// may stay here, stale, until `acquire` skips it.
    free: BinaryHeap<Reverse<u32>>,
    next_order: u64,
}

/// One tenant's row, as `rows` copies it (the counters are read after, without the lock).
pub struct Row {
    pub id: u32,
    pub salt: Option<Arc<[u8]>>,
    pub quota: Quota,
    pub order: u64,
}

/// What `counts` reads of a tenant.
pub struct Counts {
    pub cached: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

pub struct Registry {
    inner: Mutex<Inner>,
    slots: Slots,
}

impl Default for Registry {
    fn default() -> Self {
        let slots = Slots {
            segments: std::array::from_fn(|_| OnceLock::new()),
        };
        slots.make(UNSALTED);
        Self {
            inner: Mutex::new(Inner {
                ids: HashMap::new(),
                records: vec![Some(Record {
                    salt: None,
                    quota: Quota::default(),
                    order: 0,
                })],
                free: BinaryHeap::new(),
                next_order: 1,
            }),
            slots,
        }
    }
}

/// Rows copied per hold of the lock by `rows` (about 10 us), so that a call waiting for
/// the lock never waits for a whole pass over many tenants.
const ROWS_PER_LOCK: usize = 1024;

impl Registry {
    /// The id of `salt`'s tenant, made if it is not present, with one more ref for the
    /// caller (`release` gives it back). `UNSALTED` for none (never counted, never removed).
    pub fn acquire(&self, salt: Option<&[u8]>) -> u32 {
        let Some(salt) = salt else {
            return UNSALTED;
        };
        let mut inner = lock(&self.inner);
        let id = match inner.ids.get(salt) {
            Some(&id) => id,
            None => {
                let id = loop {
                    match inner.free.pop() {
                        // Skip an id freed with the table's tail (it may be past the end,
                        // or given out again by a push since).
                        Some(Reverse(id))
                            if inner.records.get(id as usize).is_some_and(Option::is_none) =>
                        {
                            break id
                        }
                        Some(_) => {}
                        None => {
                            inner.records.push(None);
                            break (inner.records.len() - 1) as u32;
                        }
                    }
                };
                let salt: Arc<[u8]> = salt.into();
                let order = inner.next_order;
                inner.next_order += 1;
                inner.records[id as usize] = Some(Record {
                    salt: Some(salt.clone()),
                    quota: Quota::default(),
                    order,
                });
                inner.ids.insert(salt, id);
                self.slots.make(id);
                id
            }
        };
        // Relaxed: under the lock, which every remover holds while it reads `refs`.
        self.slots.get(id).refs.fetch_add(1, Ordering::Relaxed);
        id
    }

    /// One more ref to `id`, for a caller that holds one (a fork's child).
    pub fn retain(&self, id: u32) {
        if id != UNSALTED {
            // Relaxed: the caller's own ref keeps the tenant meanwhile.
            self.slots.get(id).refs.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Give back a ref; the tenant leaves if that was its last thing.
    pub fn release(&self, id: u32) {
        if id == UNSALTED {
            return;
        }
        // AcqRel: see `Slot::refs`.
        if self.slots.get(id).refs.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.try_remove(id);
        }
    }

    /// `id`'s CACHED blocks went up or down by one (the pool's transitions).
    pub fn cached(&self, id: u32, up: bool) {
        self.cached_by(id, if up { 1 } else { -1 });
    }

    /// `id`'s CACHED blocks changed by `delta` in one step: a call that caches blocks and
    /// trims its tenant back under its cap counts both at once, under the policy's lock, so
    /// that a reader never sees the count between the two (over the cap).
    pub fn cached_by(&self, id: u32, delta: isize) {
        let c = &self.slots.get(id).cached;
        // Relaxed: see `Slot::cached`.
        if delta > 0 {
            c.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
        } else if delta < 0 {
            let down = delta.unsigned_abs();
            if c.fetch_sub(down, Ordering::Relaxed) == down && id != UNSALTED {
                self.try_remove(id);
            }
        }
    }

    /// Remove `id` if it has nothing left (module docs).
    fn try_remove(&self, id: u32) {
        let mut inner = lock(&self.inner);
        let slot = self.slots.get(id);
        // Acquire: see `Slot::refs`. `cached` under the lock: see `Slot::cached`.
        if slot.refs.load(Ordering::Acquire) != 0 || slot.cached.load(Ordering::Relaxed) != 0 {
            return;
        }
        let Some(Some(r)) = inner.records.get(id as usize) else {
            return;
        };
        if r.quota != Quota::default() {
            return;
        }
        let record = inner.records[id as usize].take().expect("checked above");
        if let Some(salt) = record.salt {
            inner.ids.remove(&salt);
        }
        // Relaxed: nobody names the id until `acquire` gives it out again, under the lock.
        slot.prefix_queries.store(0, Ordering::Relaxed);
        slot.prefix_hits.store(0, Ordering::Relaxed);
        inner.free.push(Reverse(id));
        // A free tail goes (its ids stay in `free` until `acquire` skips them, or the heap
        // is rebuilt once it outgrows the table), and the tables give memory back when
        // mostly empty.
        while matches!(inner.records.last(), Some(None)) {
            inner.records.pop();
        }
        let len = inner.records.len() as u32;
        if inner.free.len() > 64 && inner.free.len() > inner.records.len() {
            let kept: BinaryHeap<Reverse<u32>> = inner.free.drain().filter(|r| r.0 < len).collect();
            inner.free = kept;
        }
        if inner.records.capacity() > 64 && inner.records.len() < inner.records.capacity() / 4 {
            let n = inner.records.len() * 2;
            inner.records.shrink_to(n);
        }
        if inner.free.capacity() > 64 && inner.free.len() < inner.free.capacity() / 4 {
            let n = inner.free.len() * 2;
            inner.free.shrink_to(n);
        }
        if inner.ids.capacity() > 64 && inner.ids.len() < inner.ids.capacity() / 4 {
            let n = inner.ids.len() * 2;
            inner.ids.shrink_to(n);
        }
    }

    /// The id of `salt`'s tenant, if it is present (nothing made).
    pub fn find(&self, salt: Option<&[u8]>) -> Option<u32> {
        match salt {
            None => Some(UNSALTED),
            Some(s) => lock(&self.inner).ids.get(s).copied(),
        }
    }

    /// Count a successful allocation of `queries` prompt tokens, `hits` of them cached.
    pub fn record(&self, id: u32, queries: usize, hits: usize) {
        let s = self.slots.get(id);
        // Relaxed: tallies.
        s.prefix_queries
            .fetch_add(queries as u64, Ordering::Relaxed);
        s.prefix_hits.fetch_add(hits as u64, Ordering::Relaxed);
    }

    /// Set the quota of `id` (the caller holds a ref; `Quota::default()`: none).
    pub fn set_quota(&self, id: u32, quota: Quota) {
        if let Some(Some(r)) = lock(&self.inner).records.get_mut(id as usize) {
            r.quota = quota;
        }
    }

    /// Every present tenant, in no order, copied a chunk of ids per hold of the lock: a
    /// tenant that comes or goes meanwhile may be missed or listed (a snapshot, exact at
    /// quiescence).
    pub fn rows(&self) -> Vec<Row> {
        let mut out = Vec::new();
        let mut start = 0;
        loop {
            let inner = lock(&self.inner);
            let end = inner.records.len().min(start + ROWS_PER_LOCK);
            for (i, r) in inner.records[start.min(end)..end].iter().enumerate() {
                if let Some(r) = r {
                    out.push(Row {
                        id: (start + i) as u32,
                        salt: r.salt.clone(),
                        quota: r.quota,
                        order: r.order,
                    });
                }
            }
            if end >= inner.records.len() {
                return out;
            }
            start = end;
        }
    }

    /// `id`'s counters, read without the lock.
    pub fn counts(&self, id: u32) -> Counts {
        let s = self.slots.get(id);
        // Relaxed: tallies, each read on its own.
        Counts {
            // A revival may count down before the release that cached it counts up (a pinned
            // block's takes no lock): a moment below zero reads as zero.
            cached: (s.cached.load(Ordering::Relaxed) as isize).max(0) as usize,
            prefix_queries: s.prefix_queries.load(Ordering::Relaxed),
            prefix_hits: s.prefix_hits.load(Ordering::Relaxed),
        }
    }

    /// `id`'s refs (loom models).
    #[cfg(loom)]
    pub fn refs(&self, id: u32) -> usize {
        // Relaxed: read after the threads joined.
        self.slots.get(id).refs.load(Ordering::Relaxed)
    }

    /// Tenants present (the unsalted one included).
    pub fn len(&self) -> usize {
        lock(&self.inner).ids.len() + 1
    }

    /// Heap bytes of the registry: its salts, tables and counters (tests and benchmarks).
    pub fn bytes(&self) -> usize {
        let inner = lock(&self.inner);
        let salts: usize = inner.ids.keys().map(|s| s.len() + 16).sum();
        salts
            + inner.ids.capacity() * (size_of::<(Arc<[u8]>, u32)>() + 1)
            + inner.records.capacity() * size_of::<Option<Record>>()
            + inner.free.capacity() * size_of::<u32>()
            + self.slots.bytes()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Registry;

    #[test]
    fn a_netted_change_counts_at_once_and_the_last_one_removes_the_tenant() {
        let r = Registry::default();
        let id = r.acquire(Some(b"a"));
        r.cached_by(id, 3);
        assert_eq!(r.counts(id).cached, 3);
        r.release(id); // its last ref: the cached blocks keep it
        assert_eq!(r.len(), 2);
        r.cached_by(id, 0); // a step that netted to nothing changes nothing
        assert_eq!(r.counts(id).cached, 3);
        r.cached_by(id, -2);
        assert_eq!((r.counts(id).cached, r.len()), (1, 2));
        // Down by more than one to zero in one step: the tenant leaves then.
        r.cached_by(id, 1);
        r.cached_by(id, -2);
        assert_eq!(r.len(), 1, "a tenant with nothing left is removed");
    }
}
