//! `evict_blocks`, `allocation_cost` and `lookup_blocks` (`pool_calls`), and the pool's
//! `withdraw` racing a pin that is then given back.

use crate::block_pool::{BlockPool, Hit, Withdrawal};
use crate::keys::PromptKeys;

/// The query options of the pool calls: extra keys and a cap on the hit.
fn q<'a>(
    cache_salt: Option<&'a [u8]>,
    lora_id: Option<u64>,
    max_hit_tokens: Option<usize>,
) -> PromptKeys<'a> {
    PromptKeys {
        cache_salt,
        lora_id,
        block_hashes: None,
        max_hit_tokens,
        loaded_tokens: 0,
    }
}
use crate::hashing::sample_digests;
use crate::{BlockManager, Config, Error, GroupKind, KvEvent, Medium, NULL};
use std::sync::Arc;

fn manager(num_blocks: u32, block_size: usize) -> BlockManager {
    let mut c = Config::new(num_blocks, block_size);
    c.enable_kv_events = true;
    c.watermark = 0.0;
    BlockManager::new(c).unwrap()
}

fn removed(events: &[KvEvent]) -> Vec<(crate::Digest, u8)> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved {
                block_hash,
                medium: Medium::Gpu,
                group,
            } => Some((*block_hash, *group)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_cached_block_becomes_free_and_a_held_one_loses_its_registration() {
    let m = manager(8, 2);
    let prompt = [1, 2, 3, 4, 5, 6, 7];
    m.allocate(1, &prompt, None, None, 0).unwrap().unwrap();
    let table = m.block_table(1).unwrap();
    let digests = m.block_hashes(1).unwrap();
    m.free(1).unwrap();
    m.allocate(2, &prompt[..5], None, None, 0).unwrap().unwrap(); // hits blocks 0 and 1
    assert_eq!(m.block_table(2).unwrap()[..2], table[..2]);
    m.drain_events().unwrap();
    let before = m.stats();
    // table[1] is held by sequence 2, table[2] CACHED, table[3] was never full: not cached.
    assert_eq!(
        m.evict_blocks(&[table[1], table[2], table[3], table[2]]),
        Ok(2)
    );
    m.check_invariants().unwrap();
    let after = m.stats();
    assert_eq!(after.unregistered_blocks, before.unregistered_blocks + 2);
    assert_eq!(
        (after.free_blocks, after.cached_blocks),
        (before.free_blocks + 1, 0)
    );
    assert_eq!(
        after.evictions, before.evictions,
        "not an eviction for room"
    );
    assert_eq!(
        m.num_available_blocks(),
        before.free_blocks + before.cached_blocks
    );
    assert_eq!(
        removed(&m.drain_events().unwrap()),
        vec![(digests[1], 0), (digests[2], 0)]
    );
    // Later lookups stop at the first withdrawn block; the holder keeps it.
    assert_eq!(m.lookup(&prompt, None, None), Ok(2));
    assert_eq!(m.block_table(2).unwrap()[1], table[1]);
    // The FREE block is on top of the free stack: the next block taken.
    m.allocate(3, &[9, 9, 9], None, None, 0).unwrap().unwrap();
    assert_eq!(m.block_table(3).unwrap()[0], table[2]);
    // At free, the withdrawn block becomes FREE, not CACHED; block 0 stays cached.
    m.free(2).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.num_cached_blocks(), 1);
    assert_eq!(m.lookup(&prompt, None, None), Ok(2));
    assert_eq!(m.evict_blocks(&[table[1]]), Ok(0), "no longer cached");
}

#[test]
fn bad_ids_are_refused_before_anything_changes() {
    let m = manager(4, 2);
    m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
    m.free(1).unwrap();
    let cached = m.num_cached_blocks();
    assert_eq!(cached, 1);
    let err = m.evict_blocks(&[0, 1, 4]).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(msg) if msg.contains("block 4")),
        "{err:?}"
    );
    assert_eq!(
        m.num_cached_blocks(),
        cached,
        "the valid ids before it kept too"
    );
    m.check_invariants().unwrap();

    let g = BlockManager::with_groups(
        Config::new(6, 2),
        vec![GroupKind::Full, GroupKind::SlidingWindow { window: 2 }],
    )
    .unwrap();
    let err = g.evict_blocks(&[NULL]).unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument(msg) if msg.contains("null block")));
    // Without a null block (one full group), block 0 is an ordinary block: here the cached one.
    assert_eq!(m.evict_blocks(&[0]), Ok(1));
    m.check_invariants().unwrap();
}

#[test]
fn cost_and_blocks_are_what_allocate_takes() {
    let m = manager(12, 2);
    let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    m.allocate(1, &prompt, None, None, 0).unwrap().unwrap();
    let table = m.block_table(1).unwrap();
    m.free(1).unwrap();
    m.allocate(2, &prompt[..3], None, None, 0).unwrap().unwrap(); // block 0 held again
                                                                  // Hit of 4 blocks (capped at (9 - 1) / 2), one held and three CACHED.
    assert_eq!(
        m.lookup_blocks(&prompt, &q(None, None, None)),
        Ok((8, vec![table[..4].to_vec()]))
    );
    assert_eq!(
        m.allocation_cost(&prompt, None, &q(None, None, None), 0),
        Ok((8, 1, 3))
    );
    assert_eq!(
        m.allocation_cost(&prompt, Some(1), &q(None, None, None), 3),
        Ok((8, 2, 3)),
        "lookahead slots past the one new token"
    );
    assert_eq!(
        m.allocation_cost(&prompt, None, &q(None, None, Some(5)), 0),
        Ok((4, 3, 1)),
        "max_hit_tokens 5: two blocks"
    );
    assert_eq!(
        m.lookup_blocks(&prompt, &q(None, None, Some(1))),
        Ok((0, vec![vec![]]))
    );
    assert_eq!(
        m.allocation_cost(&prompt, None, &q(Some(b"salt"), None, None), 0),
        Ok((0, 5, 0))
    );
    assert_eq!(m.allocation_cost_count(9, Some(3), 1), Ok((0, 2, 0)));
    assert!(m.allocation_cost_count(0, None, 0).is_err());
    assert!(m.allocation_cost_count(3, Some(4), 0).is_err());
    assert_eq!(
        m.allocation_cost_count(u64::MAX, None, usize::MAX),
        Ok((0, usize::MAX, 0)),
        "saturates"
    );
    // allocate takes exactly that: one fresh block and three revivals out of `available`.
    let available = m.num_available_blocks();
    assert_eq!(m.allocate(3, &prompt, None, None, 0), Ok(Some(8)));
    assert_eq!(m.num_available_blocks(), available - 4);
    assert_eq!(m.block_table(3).unwrap()[..4], table[..4]);
    m.check_invariants().unwrap();
}

#[test]
fn with_groups_each_group_reports_its_hit_and_evicts_its_blocks() {
    let mut c = Config::new(16, 2);
    c.enable_kv_events = true;
    let kinds = vec![GroupKind::Full, GroupKind::SlidingWindow { window: 2 }];
    let m = BlockManager::with_groups(c, kinds).unwrap();
    let prompt = [1, 2, 3, 4, 5, 6, 7];
    m.allocate(1, &prompt, None, None, 0).unwrap().unwrap();
    let full = m.block_table_of(1, 0).unwrap();
    let window = m.block_table_of(1, 1).unwrap();
    let digests = m.block_hashes(1).unwrap();
    m.free(1).unwrap();
    m.drain_events().unwrap();
    // Hit of 3 blocks: the window group needs only the last one.
    let (h, tables) = m.lookup_blocks(&prompt, &q(None, None, None)).unwrap();
    assert_eq!(h, 6);
    assert_eq!(tables[0], full[..3].to_vec());
    assert_eq!(tables[1], vec![NULL, NULL, window[2]]);
    // 4 CACHED blocks revived; one new entry in each group.
    assert_eq!(
        m.allocation_cost(&prompt, None, &q(None, None, None), 0),
        Ok((6, 2, 4))
    );
    assert_eq!(m.allocation_cost_count(7, None, 0), Ok((0, 8, 0)));
    // Withdraw the window group's last block: the hit falls to where the window is whole.
    assert_eq!(m.evict_blocks(&[window[2]]), Ok(1));
    assert_eq!(removed(&m.drain_events().unwrap()), vec![(digests[2], 1)]);
    m.check_invariants().unwrap();
    let (h, tables) = m.lookup_blocks(&prompt, &q(None, None, None)).unwrap();
    assert_eq!((h, tables[1].clone()), (4, vec![NULL, window[1]]));
    let stats = m.group_stats();
    assert_eq!(stats[1].cached_blocks, 2);
    let available = m.num_available_blocks();
    assert_eq!(m.allocate(2, &prompt, None, None, 0), Ok(Some(4)));
    assert_eq!(m.block_table_of(2, 1).unwrap()[..2], [NULL, window[1]]);
    // 2 + 1 revived, 2 new entries per group.
    assert_eq!(m.num_available_blocks(), available - 7);
    m.check_invariants().unwrap();
}

#[test]
fn a_block_withdrawn_while_pinned_is_freed_when_given_back() {
    let pool = BlockPool::new(2, false, false).unwrap();
    let d = sample_digests(1)[0];
    assert!(pool.reserve(1));
    let b = pool.take();
    assert!(pool.register(b, d, None, || KvEvent::AllBlocksCleared));
    pool.release(b, Some(&d)).unwrap();
    let mut spare = 0;
    // A failing allocation revived it...
    assert_eq!(
        pool.pin(&d, None, &mut spare),
        Ok(Hit::Pinned {
            block: b,
            revived: true
        })
    );
    // ...evict_blocks withdrew it meanwhile...
    assert_eq!(pool.withdraw(b, 32), Withdrawal::Unhashed);
    assert_eq!(pool.withdraw(b, 32), Withdrawal::NotCached);
    // ...and the allocation gives it back: FREE, with its unit.
    pool.unpin(b, &d).unwrap();
    assert_eq!((pool.num_free(), pool.num_cached()), (2, 0));
    assert_eq!(pool.num_available(), 2);
    pool.audit(&[0, 0]).unwrap();
}

#[test]
fn withdrawals_racing_hits_and_releases_keep_the_pool_exact() {
    // Threads pin and release one hot cached block (and take blocks) while another withdraws
    // it over and over and a third registers it again: the audit must hold at the end.
    let pool = Arc::new(BlockPool::new(4, false, false).unwrap());
    let d = sample_digests(1)[0];
    let rounds = 2000;
    std::thread::scope(|s| {
        for _ in 0..2 {
            let pool = &pool;
            s.spawn(move || {
                for _ in 0..rounds {
                    let mut spare = 0;
                    if let Ok(Hit::Pinned { block, .. }) = pool.pin(&d, None, &mut spare) {
                        pool.release(block, Some(&d)).unwrap();
                    }
                    pool.unreserve(spare);
                }
            });
        }
        let p = &pool;
        s.spawn(move || {
            for _ in 0..rounds {
                if p.reserve(1) {
                    let b = p.take();
                    let registered = p.register(b, d, None, || KvEvent::AllBlocksCleared);
                    p.release(b, registered.then_some(&d)).unwrap();
                }
            }
        });
        s.spawn(move || {
            for _ in 0..rounds {
                for b in 0..4 {
                    p.withdraw(b, 32);
                }
            }
        });
    });
    pool.audit(&[0; 4]).unwrap();
}

#[test]
fn truncating_into_a_shared_withdrawn_block_copies_it_at_once() {
    for grouped in [false, true] {
        let c = Config::new(16, 2);
        let m = if grouped {
            let kinds = vec![GroupKind::Full, GroupKind::SlidingWindow { window: 4 }];
            BlockManager::with_groups(c, kinds).unwrap()
        } else {
            BlockManager::new(c).unwrap()
        };
        m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
            .unwrap()
            .unwrap();
        m.fork(1, 2).unwrap();
        let shared = m.block_table(1).unwrap()[1];
        // Every group's block at that position (one group without groups).
        let at: Vec<u32> = (0..m.kinds().len())
            .map(|g| m.block_table_of(1, g).unwrap()[1])
            .collect();
        assert_eq!(m.evict_blocks(&at), Ok(at.len()));
        // Block 1 (tokens 3, 4) is shared and no longer cached. A partial block kept by a
        // roll-back is the sequence's own (issue 32: a shared one could be registered by
        // another holder full there), so it is copied at the roll-back, in every group...
        let pairs = m.truncate(1, 3).unwrap().unwrap();
        assert_eq!(pairs.len(), at.len(), "{pairs:?}");
        assert!(pairs.iter().any(|&(src, _)| src == shared), "{pairs:?}");
        m.check_invariants().unwrap();
        // ...and the next write into it needs no copy.
        assert_eq!(m.append(1, &[9]).unwrap(), Some(vec![]));
        m.free(1).unwrap();
        m.free(2).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(
            m.lookup(&[1, 2, 3, 4, 5], None, None),
            Ok(2),
            "grouped {grouped}"
        );
    }
}
