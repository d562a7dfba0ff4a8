//! A lookup's read of one word of holders (`word_read::read_word`, as `lookup.rs` runs it)
//! against a commit and against a slot's reuse, over `slots.rs`'s own `Slots`.
//!
//! The block map is modelled by one loom `AtomicU64` per block, word 0's bits of that block:
//! a writer sets or clears a bit with an AcqRel RMW, a lookup reads the word with an Acquire
//! load. The real map keeps the word in a shard's hash table under a read-write lock, whose
//! write unlock the next read lock acquires (Release to Acquire, as here) and whose read
//! unlock the next write lock acquires (an edge this model lacks). So the model allows every
//! reads-from the locks allow and more: a protocol that holds here holds over the map. Its
//! hash tables, growth and shards change which memory holds the word, not when a bit is seen.
//!
//! What `lookup.rs` promises, checked in every interleaving: an answer is one the word held
//! at some moment of the read (the old holder's, the new one's, or none between them), never
//! a retired holder counted together with its replacement, never a depth mixing the bits of
//! two holders of one slot.

use super::{model, Seen};
use crate::lookup::RawHit;
use crate::slots::{pack_meta, unpack_meta, word_bit, Slots};
use crate::word_read::{read_word, Blocks};
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Word 0 of each block of a request: the model of the block map (module docs).
struct Map {
    words: Vec<AtomicU64>,
}

impl Map {
    fn new(blocks: usize) -> Arc<Self> {
        Arc::new(Self {
            words: (0..blocks).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// `BlockMap::set` of each of `blocks` for `slot` (a holder's stores, or its log).
    fn set(&self, blocks: &[usize], slot: u32) {
        let (_, b) = word_bit(slot);
        for &k in blocks {
            self.words[k].fetch_or(b, Ordering::AcqRel);
        }
    }

    /// `BlockMap::unset` (`RouterIndex::unset_log`).
    fn unset(&self, blocks: &[usize], slot: u32) {
        let (_, b) = word_bit(slot);
        for &k in blocks {
            self.words[k].fetch_and(!b, Ordering::AcqRel);
        }
    }
}

/// The request `0..len` walked through the model map (`lookup.rs`'s `KeyWalk`); `walks`
/// counts the walks begun (more than one: the word was read again).
struct Walk<'a> {
    map: &'a Map,
    walks: usize,
}

impl Blocks for Walk<'_> {
    fn len(&self) -> usize {
        self.map.words.len()
    }

    fn start(&mut self, _w: usize) {
        self.walks += 1;
    }

    fn bits(&mut self, w: usize, i: usize) -> u64 {
        assert_eq!(w, 0, "the models use word 0 only");
        self.map.words[i].load(Ordering::Acquire)
    }
}

/// The lookup: word 0 read for the request `0..map.len()`, as (engine, blocks) pairs, and
/// whether it walked the blocks more than once (the word read again after a retirement).
fn lookup(slots: &Slots, map: &Map) -> (Vec<(u32, u32)>, bool) {
    assert_eq!(slots.words(), 1);
    let mut out: Vec<RawHit> = Vec::new();
    let mut walk = Walk { map, walks: 0 };
    let hit = read_word(slots, 0, &mut walk, &mut out);
    assert_eq!(hit, !out.is_empty());
    assert!(out.iter().all(|h| (h.medium, h.group) == (0, 0)));
    (
        out.iter().map(|h| (h.engine, h.blocks)).collect(),
        walk.walks > 1,
    )
}

/// A holder made as an applying call makes one: slot, then its blocks, then live.
fn new_holder(slots: &Slots, map: &Map, engine: u32, blocks: &[usize]) -> u32 {
    let s = slots.alloc(pack_meta(engine, 0, 0)).unwrap();
    map.set(blocks, s);
    slots.set_live(s);
    s
}

/// `RouterIndex::discard` of a live holder: retired, its bits cleared, its slot freed.
fn discard(slots: &Slots, map: &Map, slot: u32, blocks: &[usize]) {
    slots.retire(slot);
    map.unset(blocks, slot);
    slots.free(slot);
}

const ENGINE: u32 = 1;

/// What a lookup answered, for `Seen`: the holder before the change, the one after, neither.
const OLD: u32 = 0;
const NEW: u32 = 1;
const NEITHER: u32 = 2;
/// The lookup walked the word, saw its generation move, and walked it again.
const READ_AGAIN: u32 = 3;

/// `commit_snapshot` of engine 1: its old holder (blocks 0 and 1) is retired and its staged
/// one (block 0 only, in another slot of the same word) set live (`Slots::replace_live`, as
/// `commit_snapshot_deferred` calls it), then the old one dropped
/// (retired again, bits cleared, slot freed). The lookup answers 2 (old), 1 (new) or nothing
/// (read between the retirement and the new one going live): never both, never another depth.
#[test]
fn a_lookup_racing_a_commit_sees_the_old_holder_or_the_new_one() {
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || {
        let slots = Arc::new(Slots::new(2));
        let map = Map::new(2);
        let old = new_holder(&slots, &map, ENGINE, &[0, 1]);
        let staged = slots.alloc(pack_meta(ENGINE, 0, 0)).unwrap();
        map.set(&[0], staged);
        let committer = {
            let (slots, map) = (slots.clone(), map.clone());
            thread::spawn(move || {
                slots.replace_live([old], [staged]);
                discard(&slots, &map, old, &[0, 1]);
            })
        };
        let (got, read_again) = lookup(&slots, &map);
        committer.join().unwrap();
        if read_again {
            s.saw(READ_AGAIN);
        }
        match got.as_slice() {
            [(ENGINE, 2)] => s.saw(OLD),
            [(ENGINE, 1)] => s.saw(NEW),
            [] => s.saw(NEITHER),
            other => panic!("an answer the word never held: {other:?}"),
        }
        assert_eq!(lookup(&slots, &map), (vec![(ENGINE, 1)], false));
    });
    seen.assert_saw(&[OLD, NEW, NEITHER, READ_AGAIN]);
}

/// Engine 1 (blocks 0 and 1) is removed and its slot goes to engine 2 (blocks 0 and 2) while
/// a lookup of blocks 0, 1, 2 reads the word. A read that mixed them would answer 3 blocks
/// (0 and 1 from the old holder, 2 from the new) or 2 under engine 2's name; the lookup
/// answers (1, 2), (2, 1) or nothing. `reuse_on_one_thread`: the removal and the new holder's
/// call run on one thread; else on two, the new holder's allocation retrying until the
/// removal freed the slot (the edge from the free to the reuse is then the allocator's mutex).
fn slot_reused_mid_lookup(reuse_on_one_thread: bool, seen: &Seen) {
    let slots = Arc::new(Slots::new(1));
    let map = Map::new(3);
    let slot = new_holder(&slots, &map, 1, &[0, 1]);
    let remove = {
        let (slots, map) = (slots.clone(), map.clone());
        move || discard(&slots, &map, slot, &[0, 1])
    };
    let reuse = {
        let (slots, map) = (slots.clone(), map.clone());
        move || {
            let s = loop {
                match slots.alloc(pack_meta(2, 0, 0)) {
                    Ok(s) => break s,
                    Err(_) => thread::yield_now(),
                }
            };
            assert_eq!(s, slot, "the only slot");
            map.set(&[0, 2], s);
            slots.set_live(s);
        }
    };
    let writers = if reuse_on_one_thread {
        vec![thread::spawn(move || {
            remove();
            reuse();
        })]
    } else {
        vec![thread::spawn(remove), thread::spawn(reuse)]
    };
    let (got, read_again) = lookup(&slots, &map);
    writers.into_iter().for_each(|t| t.join().unwrap());
    if read_again {
        seen.saw(READ_AGAIN);
    }
    match got.as_slice() {
        [(1, 2)] => seen.saw(OLD),
        [(2, 1)] => seen.saw(NEW),
        [] => seen.saw(NEITHER),
        other => panic!("an answer mixing two holders of one slot: {other:?}"),
    }
    assert_eq!(unpack_meta(slots.meta(slot)).0, 2);
    assert_eq!(lookup(&slots, &map), (vec![(2, 1)], false));
}

#[test]
fn a_slot_reused_mid_lookup_is_read_again() {
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || slot_reused_mid_lookup(true, &s));
    seen.assert_saw(&[OLD, NEW, NEITHER, READ_AGAIN]);
}

#[test]
fn a_slot_freed_and_reused_by_another_thread_mid_lookup_is_read_again() {
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(4), move || slot_reused_mid_lookup(false, &s));
    seen.assert_saw(&[OLD, NEW, NEITHER, READ_AGAIN]);
}
