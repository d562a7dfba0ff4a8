//! A `BlockStored` of many blocks (a compact snapshot part's) is applied shard by shard
//! (`BlockMap::set_many`): the same blocks, tallies and invariants as applied one block at a
//! time, in word 0 and past it, with duplicates inside the event and blocks already held.

mod common;

use common::{mix, stored};
use pagedkv_router::{compact, Applied, EngineKey, Event, RouterIndex};

/// Engines 0..70 (so that the last ones hold slots past word 0), each holding some blocks;
/// then `target` is given `many` at once (bulk) or in events of 100 (block by block).
fn build(target: u64, many: &[u64], bulk: bool) -> (RouterIndex<u64>, Applied) {
    let ix = RouterIndex::<u64>::default();
    for e in 0..70u64 {
        let own: Vec<u64> = (0..50).map(|i| mix(e * 1000 + i)).collect();
        ix.apply(&EngineKey::Int(e), &[stored(&own)]).unwrap();
    }
    let mut total = Applied::default();
    let chunks: Vec<&[u64]> = if bulk {
        vec![many]
    } else {
        many.chunks(100).collect()
    };
    for c in chunks {
        let a = ix.apply(&EngineKey::Int(target), &[stored(c)]).unwrap();
        total.stored += a.stored;
        total.duplicates += a.duplicates;
    }
    (ix, total)
}

#[test]
fn bulk_equals_block_by_block_in_every_word() {
    // 5,000 blocks: 40 the target holds already, 30 held by others, 200 repeated inside.
    for target in [3u64, 69] {
        let mut many: Vec<u64> = (0..4770).map(|i| mix(1 << 40 | i)).collect();
        many.extend((0..40).map(|i| mix(target * 1000 + i)));
        many.extend((0..30).map(|i| mix(7 * 1000 + i)));
        many.extend_from_within(..200);
        let (a, ta) = build(target, &many, true);
        let (b, tb) = build(target, &many, false);
        assert_eq!((ta.stored, ta.duplicates), (tb.stored, tb.duplicates));
        assert_eq!((ta.stored, ta.duplicates), (4800, 240));
        let t = EngineKey::Int(target);
        let mut x = a.blocks_of(&t, Some("GPU"), 0);
        let mut y = b.blocks_of(&t, Some("GPU"), 0);
        x.sort_unstable();
        y.sort_unstable();
        assert_eq!(x, y);
        assert_eq!(a.stats().memberships, b.stats().memberships);
        a.check_invariants().unwrap();
        b.check_invariants().unwrap();
        // And a lookup of the bulk-stored chain.
        let hit = a.match_prefix(&many[..100]);
        assert!(
            hit.iter().any(|h| h.engine == t && h.blocks == 100),
            "{hit:?}"
        );
    }
}

#[test]
fn a_compact_part_is_a_payload_anywhere_one_is_taken() {
    let ix = RouterIndex::<u64>::default();
    let keys: Vec<u64> = (0..3000).map(mix).collect();
    let part = compact::encode(Some("CPU"), 2, &keys);
    let e = EngineKey::from("e");
    ix.begin_snapshot(&e);
    let a = ix.apply_staged_payload(&e, &part).unwrap();
    assert_eq!(a.stored, 3000);
    assert!(ix.match_prefix(&keys).is_empty()); // staged: not seen yet
    ix.commit_snapshot(&e).unwrap();
    assert_eq!(ix.blocks_of(&e, Some("CPU"), 2).len(), 3000);
    // A bad part is refused whole and counted.
    let before = ix.stats();
    assert!(ix.apply_payload(&e, &part[..part.len() - 1]).is_err());
    let after = ix.stats();
    assert_eq!(after.memberships, before.memberships);
    assert_eq!(after.rejected_payloads, before.rejected_payloads + 1);
    ix.check_invariants().unwrap();
}

/// Dropping a long log goes shard by shard (`unset_many`): a snapshot committed over an
/// engine holding thousands of blocks (in word 0 and past it), then `AllBlocksCleared`,
/// leave the other engines' bits and the invariants whole.
#[test]
fn long_logs_are_dropped_whole_and_only_theirs() {
    for target in [3u64, 69] {
        let old: Vec<u64> = (0..6000).map(|i| mix(2 << 40 | i)).collect();
        let (ix, _) = build(target, &old, false);
        let t = EngineKey::Int(target);
        let shared: Vec<u64> = (0..50).map(|i| mix(7 * 1000 + i)).collect();
        ix.begin_snapshot(&t);
        let mut new: Vec<u64> = (0..3000).map(|i| mix(3 << 40 | i)).collect();
        new.extend_from_slice(&shared);
        ix.apply_staged_payload(&t, &compact::encode(Some("GPU"), 0, &new))
            .unwrap();
        ix.commit_snapshot(&t).unwrap();
        ix.check_invariants().unwrap();
        assert!(ix.match_prefix(&old[..1]).is_empty());
        assert_eq!(ix.blocks_of(&t, Some("GPU"), 0).len(), 3050);
        // Engine 7 still holds its own blocks, the snapshot's shared ones among them.
        let hits = ix.match_prefix(&shared);
        assert!(hits
            .iter()
            .any(|h| h.engine == EngineKey::Int(7) && h.blocks == 50));
        ix.apply(&t, &[Event::Cleared]).unwrap();
        ix.check_invariants().unwrap();
        assert!(ix.blocks_of(&t, Some("GPU"), 0).is_empty());
        let hits = ix.match_prefix(&shared);
        assert_eq!(hits.len(), 1, "{hits:?}");
        assert_eq!(ix.stats().memberships, 69 * 50);
    }
}
