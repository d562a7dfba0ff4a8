//! An index large enough that its shards' tables move into the huge-page pool (`pool.rs`:
//! tables of 16 KiB and more, here up to 128 KiB a shard) and back out of it as they grow,
//! shrink away with a removed engine and are replaced by a snapshot: every answer stays the
//! one a plain model of the engines' sets gives, and the index's invariants hold.

mod common;

use common::{blocks as answers, mix, removed, stored};
use pagedkv_router::{EngineKey, RouterIndex};
use std::collections::HashSet;

/// Chain c's blocks (100 a chain).
fn chain(c: u64, salt: u64) -> Vec<u64> {
    (0..100).map(|i| mix(salt << 40 | c << 8 | i)).collect()
}

/// How many leading blocks of `keys` each engine's set holds, by the model.
fn expected(sets: &[(EngineKey, HashSet<u64>)], keys: &[u64]) -> Vec<(EngineKey, u32)> {
    let mut v: Vec<_> = sets
        .iter()
        .map(|(e, s)| {
            (
                e.clone(),
                keys.iter().take_while(|k| s.contains(k)).count() as u32,
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    v.sort();
    v
}

fn check(ix: &RouterIndex<u64>, sets: &[(EngineKey, HashSet<u64>)], probes: &[Vec<u64>]) {
    ix.check_invariants().unwrap();
    let members: usize = sets.iter().map(|(_, s)| s.len()).sum();
    assert_eq!(ix.stats().memberships, members as u64);
    for q in probes {
        assert_eq!(answers(ix, q), expected(sets, q));
    }
}

#[test]
fn answers_hold_while_tables_grow_into_huge_pages_and_are_replaced() {
    let ix = RouterIndex::<u64>::default();
    let (a, b) = (EngineKey::from("a"), EngineKey::from("b"));
    // Engine a: 3,000 chains of 100 blocks (300 K entries: about 1,200 a shard, in tables
    // of 2,048 slots, 32 KiB), in events of one chain each (block by block, as live events
    // come: each shard's table grows from the heap into a chunk of 16 KiB tables, then
    // into one of 32 KiB tables, emptying the first); b: every third chain. (Reusing a
    // table's place or a spare chunk, with its old contents, is pool.rs's own test.)
    let mut sa = HashSet::new();
    let mut sb = HashSet::new();
    for c in 0..3000 {
        let ch = chain(c, 1);
        ix.apply(&a, &[stored(&ch)]).unwrap();
        sa.extend(ch);
    }
    for c in (0..3000).step_by(3) {
        let ch = chain(c, 1);
        ix.apply(&b, &[stored(&ch)]).unwrap();
        sb.extend(ch);
    }
    // Probes: whole chains, chains cut short by a block nobody holds, unknown chains.
    let mut probes: Vec<Vec<u64>> = (0..3000).step_by(37).map(|c| chain(c, 1)).collect();
    probes.extend((1..3000).step_by(91).map(|c| {
        let mut q = chain(c, 1);
        q[50] = mix(999);
        q
    }));
    probes.push(chain(5, 2));
    let sets = |sa: &HashSet<u64>, sb: &HashSet<u64>| {
        vec![(a.clone(), sa.clone()), (b.clone(), sb.clone())]
    };
    check(&ix, &sets(&sa, &sb), &probes);

    // a drops the second half of every fifth chain (entries leave tables in the pool).
    for c in (0..3000).step_by(5) {
        let tail = chain(c, 1)[50..].to_vec();
        for k in &tail {
            sa.remove(k);
        }
        ix.apply(&a, &[removed(&tail)]).unwrap();
    }
    check(&ix, &sets(&sa, &sb), &probes);

    // A snapshot replaces a's blocks with 2,000 other chains plus the first 1,000 of its own:
    // staged beside the old ones the tables double (64 KiB a shard), then the old ones go.
    let mut snap: Vec<u64> = (0..2000).flat_map(|c| chain(c, 3)).collect();
    snap.extend((0..1000).flat_map(|c| chain(c, 1)));
    ix.begin_snapshot(&a);
    for part in snap.chunks(100_000) {
        ix.apply_staged(&a, &[stored(part)]).unwrap();
    }
    ix.commit_snapshot(&a).unwrap();
    sa = snap.iter().copied().collect();
    probes.extend((0..2000).step_by(53).map(|c| chain(c, 3)));
    check(&ix, &sets(&sa, &sb), &probes);

    // b goes: its entries are cleared, a's answers stay.
    assert!(ix.remove_engine(&b));
    let only_a = vec![(a.clone(), sa.clone())];
    check(&ix, &only_a, &probes);
    assert!(ix.remove_engine(&a));
    check(&ix, &[], &probes);
    assert_eq!(ix.stats().entries, 0);
}
