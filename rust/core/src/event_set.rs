//! The set of blocks the KV events describe (the fold of every event so far), kept so that a
//! snapshot costs the lock that every registration and eviction takes almost nothing.
//!
//! Blocks are kept in the order they were (last) stored: a log of records in chunks of
//! `CHUNK` slots, `SEG` chunks to a segment, each chunk and segment behind an `Arc`; a
//! removal leaves a tombstone (chunks are compacted, merged and freed as they empty, and so
//! are segments). A key's live record is found through `map` (its stamp, then two binary
//! searches). A snapshot, under the lock, only clones the segment list (an `Arc` per
//! segment, 64 at 1 M blocks) and the short `restored` map; it orders the blocks after the
//! lock is released, from the frozen segments, and lets go of them once it has its records.
//! A push that changes a segment or chunk a snapshot still holds copies it first
//! (`Arc::make_mut`: at most `SEG` chunk pointers and `CHUNK` slots), so no push waits for a
//! pass over the set.
//!
//! Order of a snapshot (docs/events.md): parents before children; otherwise oldest first.
//! A block is listed at its place in the log unless its parent is listed later (the parent
//! was removed and stored again after it, or is itself waiting): then right after its parent.
//! Finding "its parent is listed later" needs no lookup of every parent: a parent key stored
//! while some listed block names it as an absent parent is the only way (`orphans` counts
//! those children per absent parent; such a store goes into `restored` with its stamp).

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use crate::events::{KvEvent, Medium};
use crate::hashing::Digest;
use crate::id_hasher::IdHasher;

type Build = BuildHasherDefault<IdHasher>;

/// Slots per chunk and chunks per segment: a copy on write is at most this many.
const CHUNK: usize = 256;
const SEG: usize = 64;

/// Copies made so far because a snapshot held what a push changed (feature `lock-timing`).
#[cfg(feature = "lock-timing")]
pub(crate) static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `Arc::make_mut`: the node, copied first if a snapshot still holds it.
fn cow<T: Clone>(node: &mut Arc<T>) -> &mut T {
    #[cfg(feature = "lock-timing")]
    if Arc::strong_count(node) > 1 {
        // Relaxed: a tally.
        COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    Arc::make_mut(node)
}

/// A block's identity for indexers: medium, group and (unkeyed) digest.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct BlockKey {
    pub medium: Medium,
    pub group: u8,
    pub digest: Digest,
}

impl std::hash::Hash for BlockKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // A digest's first word is already uniform; the id hasher mixes it with the rest.
        h.write_u64(self.digest.words()[0] ^ (u64::from(self.group) << 1) ^ self.medium as u64);
    }
}

impl BlockKey {
    fn parent(&self, parent: Option<Digest>) -> Option<BlockKey> {
        parent.map(|digest| BlockKey { digest, ..*self })
    }
}

/// A described block: enough to announce it again as `BlockStored`.
pub(crate) struct Record {
    key: BlockKey,
    parent: Option<Digest>,
    /// Shared with the event that stored it.
    token_ids: Arc<[u32]>,
    lora_id: Option<u64>,
}

impl Record {
    fn event(&self) -> KvEvent {
        KvEvent::BlockStored {
            block_hash: self.key.digest,
            parent_block_hash: self.parent,
            token_ids: self.token_ids.clone(),
            lora_id: self.lora_id,
            medium: self.key.medium,
            group: self.key.group,
        }
    }
}

#[derive(Clone)]
struct Slot {
    /// When the record was stored (the log's order; unique, increasing).
    stamp: u64,
    /// None once removed (a tombstone until the chunk is compacted).
    record: Option<Arc<Record>>,
}

#[derive(Clone, Default)]
pub(crate) struct Chunk {
    slots: Vec<Slot>,
    live: usize,
}

impl Chunk {
    fn first(&self) -> u64 {
        self.slots[0].stamp
    }
}

/// Up to `SEG` chunks, in stamp order, each with a live record.
#[derive(Clone, Default)]
pub(crate) struct Seg {
    chunks: Vec<Arc<Chunk>>,
    live: usize,
}

impl Seg {
    fn first(&self) -> u64 {
        self.chunks[0].first()
    }

    /// Free chunk `c` if empty, else drop its tombstones when they are half of it, and merge
    /// it into a neighbour when both are under a quarter full (so chunks stay at least an
    /// eighth full on average, and the set's tables shrink with it).
    fn tidy(&mut self, c: usize) {
        if self.chunks[c].live == 0 {
            self.chunks.remove(c);
            return;
        }
        let small = |ch: &Chunk| ch.live < CHUNK / 4;
        let chunk = cow(&mut self.chunks[c]);
        if 2 * chunk.live <= chunk.slots.len() {
            chunk.slots.retain(|s| s.record.is_some());
            chunk.slots.shrink_to(CHUNK.min(2 * chunk.live).max(4));
        }
        if !small(chunk) {
            return;
        }
        let merge_into = if c > 0 && small(&self.chunks[c - 1]) {
            c - 1
        } else if self.chunks.get(c + 1).is_some_and(|n| small(n)) {
            c
        } else {
            return;
        };
        let later = self.chunks.remove(merge_into + 1);
        let into = cow(&mut self.chunks[merge_into]);
        into.slots.retain(|s| s.record.is_some());
        into.slots
            .extend(later.slots.iter().filter(|s| s.record.is_some()).cloned());
        into.live += later.live;
    }
}

/// A live key's place and its children count.
struct Place {
    stamp: u64,
    /// Described blocks whose parent is this key (moved to `orphans` while it is absent).
    kids: u32,
}

#[derive(Default)]
pub(crate) struct EventSet {
    map: HashMap<BlockKey, Place, Build>,
    /// In stamp order, each with a live record (empty chunks and segments are dropped).
    segs: Vec<Arc<Seg>>,
    /// Absent parent key -> described blocks that name it.
    orphans: HashMap<BlockKey, u32, Build>,
    /// Keys stored while `orphans` had children for them -> the stamp of that store (kept
    /// while that record is live): their children come earlier in the log.
    restored: HashMap<BlockKey, u64, Build>,
    next: u64,
}

impl EventSet {
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// `BlockStored`: the block is described now, as the newest.
    pub(crate) fn store(
        &mut self,
        key: BlockKey,
        parent: Option<Digest>,
        token_ids: &Arc<[u32]>,
        lora_id: Option<u64>,
    ) {
        self.remove(&key);
        // Never wraps in practice: one event a nanosecond for 584 years.
        let stamp = self.next;
        self.next += 1;
        let kids = self.orphans.remove(&key).unwrap_or(0);
        if kids > 0 {
            self.restored.insert(key, stamp);
        }
        if let Some(pk) = key.parent(parent) {
            self.adopt(&pk, true);
        }
        self.map.insert(key, Place { stamp, kids });
        let record = Arc::new(Record {
            key,
            parent,
            token_ids: token_ids.clone(),
            lora_id,
        });
        let slot = Slot {
            stamp,
            record: Some(record),
        };
        let new_chunk = |slot| {
            let mut slots = Vec::with_capacity(CHUNK);
            slots.push(slot);
            Arc::new(Chunk { slots, live: 1 })
        };
        let seg = match self.segs.last_mut() {
            Some(seg) if seg.chunks.len() < SEG || seg.chunks[SEG - 1].slots.len() < CHUNK => {
                cow(seg)
            }
            _ => {
                self.segs.push(Arc::default());
                cow(self.segs.last_mut().expect("pushed"))
            }
        };
        seg.live += 1;
        match seg.chunks.last_mut() {
            Some(last) if last.slots.len() < CHUNK => {
                let last = cow(last);
                last.slots.push(slot);
                last.live += 1;
            }
            _ => seg.chunks.push(new_chunk(slot)),
        }
    }

    /// One child more (`up`) or fewer for parent key `pk`, wherever its count lives.
    fn adopt(&mut self, pk: &BlockKey, up: bool) {
        let count = match self.map.get_mut(pk) {
            Some(p) => &mut p.kids,
            None => self.orphans.entry(*pk).or_insert(0),
        };
        if up {
            *count += 1;
        } else {
            *count = count.saturating_sub(1);
            if *count == 0 && !self.map.contains_key(pk) {
                self.orphans.remove(pk);
            }
        }
    }

    /// `BlockRemoved`: the block is no longer described.
    pub(crate) fn remove(&mut self, key: &BlockKey) {
        let Some(place) = self.map.remove(key) else {
            return;
        };
        if place.kids > 0 {
            *self.orphans.entry(*key).or_insert(0) += place.kids;
        }
        if self.restored.get(key) == Some(&place.stamp) {
            self.restored.remove(key);
        }
        let g = self.segs.partition_point(|g| g.first() <= place.stamp) - 1;
        let seg = cow(&mut self.segs[g]);
        let c = seg.chunks.partition_point(|c| c.first() <= place.stamp) - 1;
        let chunk = cow(&mut seg.chunks[c]);
        let i = chunk
            .slots
            .binary_search_by_key(&place.stamp, |s| s.stamp)
            .expect("a live key's slot");
        let record = chunk.slots[i].record.take().expect("a live record");
        chunk.live -= 1;
        seg.live -= 1;
        seg.tidy(c);
        self.tidy(g);
        if let Some(pk) = key.parent(record.parent) {
            self.adopt(&pk, false);
        }
    }

    /// Free segment `g` if empty, and merge it into a neighbour when both have under a
    /// quarter of their chunks (so a snapshot's copy of the list stays short).
    fn tidy(&mut self, g: usize) {
        if self.segs[g].live == 0 {
            self.segs.remove(g);
            return;
        }
        let small = |s: &Seg| s.chunks.len() < SEG / 4;
        if !small(&self.segs[g]) {
            return;
        }
        let merge_into = if g > 0 && small(&self.segs[g - 1]) {
            g - 1
        } else if self.segs.get(g + 1).is_some_and(|n| small(n)) {
            g
        } else {
            return;
        };
        let later = self.segs.remove(merge_into + 1);
        let into = cow(&mut self.segs[merge_into]);
        into.chunks.extend(later.chunks.iter().cloned());
        into.live += later.live;
    }

    /// `AllBlocksCleared`; returns the old set, to free after the lock.
    pub(crate) fn clear(&mut self) -> EventSet {
        let next = self.next;
        std::mem::replace(
            self,
            Self {
                next,
                ..Self::default()
            },
        )
    }

    /// What a snapshot needs of the set now (under the log's lock): the segments and
    /// `restored`, both cheap to clone.
    pub(crate) fn freeze(&self) -> Frozen {
        Frozen {
            segs: self.segs.clone(),
            restored: self.restored.clone(),
            len: self.map.len(),
        }
    }

    /// Heap bytes of the set's own tables (its records and tokens not counted).
    #[cfg(all(test, not(loom)))]
    fn table_bytes(&self) -> usize {
        self.segs
            .iter()
            .flat_map(|g| g.chunks.iter())
            .map(|c| c.slots.capacity() * size_of::<Slot>())
            .sum::<usize>()
            + self.map.capacity() * (size_of::<(BlockKey, Place)>() + 1)
    }
}

/// The set as a snapshot took it, to be ordered without the lock.
pub(crate) struct Frozen {
    segs: Vec<Arc<Seg>>,
    restored: HashMap<BlockKey, u64, Build>,
    len: usize,
}

/// The blocks a snapshot lists, in order, as `BlockStored` events made on demand (a
/// pointer a block: the records are shared with the set, or kept for the snapshot alone
/// once the set let go of them).
pub struct EventSnapshot {
    records: Vec<Arc<Record>>,
}

impl Frozen {
    /// Order the frozen set (module docs).
    pub(crate) fn order(self) -> EventSnapshot {
        let mut order: Vec<Arc<Record>> = Vec::with_capacity(self.len);
        // Waiting for their parent (listed later): parent key -> (stamp, record), in order.
        type Waiting = Vec<(u64, Arc<Record>)>;
        let mut waiting: HashMap<BlockKey, Waiting, Build> = HashMap::default();
        let mut waiting_keys: HashSet<BlockKey, Build> = HashSet::default();
        let slots = self
            .segs
            .iter()
            .flat_map(|g| g.chunks.iter())
            .flat_map(|c| c.slots.iter());
        for slot in slots {
            let Some(r) = &slot.record else { continue };
            // The common case (no block stored after its children): no lookup at all.
            if !self.restored.is_empty() || !waiting_keys.is_empty() {
                if let Some(pk) = r.key.parent(r.parent) {
                    let later = waiting_keys.contains(&pk)
                        || self.restored.get(&pk).is_some_and(|&t| t > slot.stamp);
                    if later {
                        waiting.entry(pk).or_default().push((slot.stamp, r.clone()));
                        waiting_keys.insert(r.key);
                        continue;
                    }
                }
            }
            order.push(r.clone());
            if waiting.is_empty() {
                continue;
            }
            // Its waiting children right after it, each followed by its own (depth first;
            // children in the log's order).
            let mut stack = Vec::new();
            if let Some(kids) = waiting.remove(&r.key) {
                stack.push(kids.into_iter());
            }
            while let Some(top) = stack.last_mut() {
                let Some((_, kid)) = top.next() else {
                    stack.pop();
                    continue;
                };
                waiting_keys.remove(&kid.key);
                if let Some(kids) = waiting.remove(&kid.key) {
                    stack.push(kids.into_iter());
                }
                order.push(kid);
            }
        }
        // Left waiting: a parent cycle (only colliding digests make one). In log order.
        let mut rest: Waiting = waiting.into_values().flatten().collect();
        rest.sort_unstable_by_key(|(stamp, _)| *stamp);
        order.extend(rest.into_iter().map(|(_, r)| r));
        EventSnapshot { records: order }
    }
}

impl EventSnapshot {
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The snapshot's `BlockStored` events, in order.
    pub fn iter(&self) -> impl Iterator<Item = KvEvent> + '_ {
        self.records.iter().map(|r| r.event())
    }

    pub fn to_vec(&self) -> Vec<KvEvent> {
        self.iter().collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn d(token: u32) -> Digest {
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        h.hash_block(&h.root(), &[token], &[0])
    }

    fn key(t: u32) -> BlockKey {
        BlockKey {
            medium: Medium::Gpu,
            group: 0,
            digest: d(t),
        }
    }

    /// Token of each digest `d(t)`, `t < 40,000` (by its first word).
    fn names() -> &'static HashMap<u64, u32> {
        static NAMES: std::sync::OnceLock<HashMap<u64, u32>> = std::sync::OnceLock::new();
        NAMES.get_or_init(|| (0..40_000).map(|t| (d(t).words()[0], t)).collect())
    }

    /// The order spelled out plainly (the reference's): blocks by when stored; one whose
    /// parent is listed later, or waits, waits for it and comes right after it.
    fn plain_order(log: &[(u32, Option<u32>)]) -> Vec<u32> {
        let pos: HashMap<u32, usize> = log.iter().enumerate().map(|(i, &(k, _))| (k, i)).collect();
        let mut out = Vec::new();
        let mut waiting: HashMap<u32, Vec<u32>> = HashMap::new();
        let mut wait_set: HashSet<u32> = HashSet::new();
        fn emit(k: u32, out: &mut Vec<u32>, w: &mut HashMap<u32, Vec<u32>>, ws: &mut HashSet<u32>) {
            out.push(k);
            ws.remove(&k);
            for kid in w.remove(&k).unwrap_or_default() {
                emit(kid, out, w, ws);
            }
        }
        for (i, &(k, p)) in log.iter().enumerate() {
            if let Some(p) = p {
                if wait_set.contains(&p) || pos.get(&p).is_some_and(|&j| j > i) {
                    waiting.entry(p).or_default().push(k);
                    wait_set.insert(k);
                    continue;
                }
            }
            emit(k, &mut out, &mut waiting, &mut wait_set);
        }
        let mut rest: Vec<u32> = wait_set.into_iter().collect();
        rest.sort_by_key(|k| pos[k]);
        out.extend(rest);
        out
    }

    fn listed(s: &EventSnapshot) -> Vec<u32> {
        s.iter()
            .map(|e| match e {
                KvEvent::BlockStored { block_hash, .. } => names()[&block_hash.words()[0]],
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn random_stores_and_removals_order_as_the_plain_rule_says() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let tokens: Arc<[u32]> = vec![1, 2].into();
        for round in 0..300 {
            let mut set = EventSet::default();
            // The plain model: (key, parent) in the order stored.
            let mut log: Vec<(u32, Option<u32>)> = Vec::new();
            // Mostly small sets; every 100th round one of many chunks and two segments.
            let (keys, ops) = if round % 100 == 0 {
                (40_000, 120_000)
            } else {
                (2 + rnd(40) as u32, rnd(2000))
            };
            for _ in 0..ops {
                let k = rnd(u64::from(keys)) as u32;
                match rnd(10) {
                    0..=5 => {
                        // Mostly chains (parent k - 1), sometimes any parent, a cycle too.
                        let p = match rnd(4) {
                            0 => None,
                            1 => Some(rnd(u64::from(keys)) as u32),
                            _ => k.checked_sub(1),
                        };
                        set.store(key(k), p.map(d), &tokens, None);
                        if let Some(i) = log.iter().rposition(|&(x, _)| x == k) {
                            log.remove(i);
                        }
                        log.push((k, p));
                    }
                    6..=8 => {
                        set.remove(&key(k));
                        if let Some(i) = log.iter().rposition(|&(x, _)| x == k) {
                            log.remove(i);
                        }
                    }
                    _ if rnd(20) == 0 => {
                        set.clear();
                        log.clear();
                    }
                    _ => {}
                }
                assert_eq!(set.len(), log.len());
            }
            let snap = set.freeze().order();
            assert_eq!(listed(&snap), plain_order(&log), "round {round}");
        }
    }

    #[test]
    fn a_snapshot_keeps_its_blocks_while_the_set_changes() {
        let tokens: Arc<[u32]> = vec![1].into();
        let mut set = EventSet::default();
        for t in 0..40 {
            set.store(key(t), t.checked_sub(1).map(d), &tokens, None);
        }
        let frozen = set.freeze();
        for t in 0..40 {
            set.remove(&key(t));
        }
        set.store(key(50), None, &tokens, None);
        let snap = frozen.order();
        assert_eq!(listed(&snap), (0..40).collect::<Vec<_>>());
        assert_eq!(listed(&set.freeze().order()), vec![50]);
    }

    #[test]
    fn chunks_give_memory_back_as_blocks_leave() {
        let tokens: Arc<[u32]> = vec![1].into();
        let mut set = EventSet::default();
        let n = 64 * CHUNK as u32;
        let k = |t: u32| BlockKey {
            medium: Medium::Gpu,
            group: 0,
            digest: Digest::from_words(
                [u64::from(t).wrapping_mul(0x9e37_79b9_7f4a_7c15), 1, 0, 0],
                16,
            ),
        };
        for t in 0..n {
            set.store(k(t), None, &tokens, None);
        }
        let before = set.table_bytes();
        // Every other block, then all but one in 64: chunks compact, merge and go.
        for t in (0..n).filter(|t| t % 64 != 0) {
            set.remove(&k(t));
        }
        assert_eq!(set.len(), n as usize / 64);
        let chunks = set.segs.iter().flat_map(|g| g.chunks.iter());
        assert!(
            chunks.clone().count() <= 8,
            "{} chunks",
            chunks.clone().count()
        );
        assert_eq!(set.segs.len(), 1);
        let slots: usize = chunks.map(|c| c.slots.capacity()).sum();
        assert!(
            slots <= 4 * set.len(),
            "{slots} slots left for {} blocks",
            set.len()
        );
        // The key map keeps its capacity (rehashing it smaller would hold the lock for a
        // pass over it); the log's chunks went.
        let map = set.map.capacity() * (size_of::<(BlockKey, Place)>() + 1);
        assert!(set.table_bytes() - map < (before - map) / 8);
        assert!(set.orphans.is_empty() && set.restored.is_empty());
    }
}
