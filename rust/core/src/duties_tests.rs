//! `duties::capture` around the managers' public calls: each call gets exactly the cached
//! blocks it evicted, none of another thread's, and a call that does not fit or fails
//! evicts nothing.

use crate::duties::{capture, Evicted};
use crate::{BlockManager, Config, Error, GroupKind};
use std::collections::HashSet;
use std::sync::Arc;

fn recording(num_blocks: u32, block_size: usize) -> Config {
    let mut c = Config::new(num_blocks, block_size);
    c.record_evictions = true;
    c
}

fn blocks(ev: &[Evicted]) -> HashSet<u32> {
    ev.iter().map(|e| e.0).collect()
}

#[test]
fn an_allocation_gets_the_blocks_it_evicted_and_a_refused_one_none() {
    let m = BlockManager::new(recording(4, 2)).unwrap();
    m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
        .unwrap()
        .unwrap();
    let cached: HashSet<u32> = m.block_table(1).unwrap()[..2].iter().copied().collect();
    let digests = m.block_hashes(1).unwrap();
    m.free(1).unwrap();
    // Too long for the pool: refused before anything is taken.
    let (none, ev) = capture(|| m.allocate(2, &[9; 11], None, None, 0));
    assert_eq!(none, Ok(None));
    assert!(ev.is_empty());
    // A call that fails its checks takes nothing either.
    let (err, ev) = capture(|| m.extend(7, 1, 0));
    assert!(matches!(err, Err(Error::UnknownSequence(7))));
    assert!(ev.is_empty());
    let (hit, ev) = capture(|| m.allocate(2, &[9; 8], None, None, 0));
    assert_eq!(hit, Ok(Some(0)));
    assert_eq!(blocks(&ev), cached);
    assert!(ev.iter().all(|(_, g, d)| *g == 0 && digests.contains(d)));
    let table: HashSet<u32> = m.block_table(2).unwrap().into_iter().collect();
    assert!(
        blocks(&ev).is_subset(&table),
        "evicted blocks go to the caller"
    );
    assert_eq!(m.stats().evictions, 2);
}

#[test]
fn without_record_evictions_nothing_is_reported() {
    let m = BlockManager::new(Config::new(4, 2)).unwrap();
    m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
        .unwrap()
        .unwrap();
    m.free(1).unwrap();
    let (_, ev) = capture(|| m.allocate(2, &[9; 8], None, None, 0));
    assert!(ev.is_empty());
    assert_eq!(m.stats().evictions, 2);
}

#[test]
fn an_error_after_an_eviction_still_returns_it() {
    // Only a broken manager fails after taking a block; whatever the cause, `capture`
    // returns what was evicted with the error, so the caller still copies it out.
    let m = BlockManager::new(recording(4, 2)).unwrap();
    m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
        .unwrap()
        .unwrap();
    m.free(1).unwrap();
    let (out, ev) = capture(|| -> Result<(), Error> {
        m.allocate(2, &[9; 8], None, None, 0)?;
        Err(Error::Broken("after the take".into()))
    });
    assert!(out.is_err());
    assert_eq!(ev.len(), 2);
}

#[test]
fn threads_get_only_their_own_evictions() {
    let m = Arc::new(BlockManager::new(recording(64, 4)).unwrap());
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let m = Arc::clone(&m);
            std::thread::spawn(move || {
                let mut reported = 0;
                for n in 0..300u32 {
                    let id = u64::from(t * 1000 + n);
                    // Every fourth prompt new content: the pool (64 blocks) fills up and
                    // evicts whatever the threads' timing, while the others hit.
                    let base = if n % 4 == 0 {
                        t * 100_000 + n * 64
                    } else {
                        t * 100
                    };
                    let prompt: Vec<u32> = (0..4 * (2 + n % 5)).map(|j| base + j).collect();
                    let (got, ev) = capture(|| m.allocate(id, &prompt, None, None, 0));
                    if got.unwrap().is_none() {
                        assert!(ev.is_empty());
                        continue;
                    }
                    let table: HashSet<u32> = m.block_table(id).unwrap().into_iter().collect();
                    assert!(blocks(&ev).is_subset(&table), "another call's eviction");
                    reported += ev.len() as u64;
                    let (_, ev) = capture(|| m.append(id, &[7, 7, 7, 7, 7]));
                    let table: HashSet<u32> = m.block_table(id).unwrap().into_iter().collect();
                    assert!(blocks(&ev).is_subset(&table));
                    reported += ev.len() as u64;
                    m.free(id).unwrap();
                }
                reported
            })
        })
        .collect();
    let reported: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(reported, m.stats().evictions);
    assert!(reported > 300, "{reported}");
    m.check_invariants().unwrap();
}

#[test]
fn the_grouped_manager_reports_each_group() {
    let kinds = vec![GroupKind::Full, GroupKind::SlidingWindow { window: 4 }];
    let m = BlockManager::with_groups(recording(9, 2), kinds).unwrap();
    let mut prompt = vec![1, 2, 3, 4, 5];
    m.allocate_from(1, &mut prompt, None, None, None, 0)
        .unwrap()
        .unwrap();
    m.free_computed(1, None).unwrap();
    let mut other = vec![9; 8];
    let (hit, ev) = capture(|| m.allocate_from(2, &mut other, None, None, None, 0));
    assert_eq!(hit, Ok(Some(0)));
    let groups: HashSet<u8> = ev.iter().map(|e| e.1).collect();
    assert_eq!(groups, HashSet::from([0, 1]));
    assert_eq!(ev.len() as u64, m.stats().evictions);
    let mut held = HashSet::new();
    for g in 0..2 {
        held.extend(m.block_table_of(2, g).unwrap());
    }
    assert!(blocks(&ev).is_subset(&held));
}
