//! The partial block a sequence writes next is never hashed (issue 32, item 1): the audit
//! flags a state where it is, and a write into it copies it first (defence in depth), so
//! that the KV cached under its digest is never overwritten. The state cannot arise through
//! the API (`truncate` leaves its partial block exclusive and unhashed): it is made by hand.

use crate::events::KvEvent;
use crate::hashing::Digest;
use crate::sync::lock;
use crate::{BlockManager, Config, Error, GroupKind};

/// Sequence 1 holds `[1, 2, 3]` (block size 2), its partial block 1 registered by hand
/// under a digest of its own: the state the sequence of calls made.
fn corrupted(m: &BlockManager) -> (u32, Digest) {
    m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
    m.check_invariants().unwrap();
    let b = m.block_table(1).unwrap()[1];
    let digest = Digest::from_words([7, 7, 7, 7], m.hasher.root().as_bytes().len());
    assert!(m
        .gpu
        .register(b, digest, None, || KvEvent::AllBlocksCleared));
    (b, digest)
}

fn violation(m: &BlockManager) -> String {
    match m.check_invariants() {
        Err(Error::Invariant(msg)) => msg,
        other => panic!("a hashed partial block not detected: {other:?}"),
    }
}

#[test]
fn the_audit_flags_a_hashed_partial_last_block() {
    let m = BlockManager::new(Config::new(8, 2)).unwrap();
    corrupted(&m);
    assert!(violation(&m).contains("hashed block"), "{}", violation(&m));
}

#[test]
fn appending_into_a_hashed_partial_block_copies_it() {
    for batch in [false, true] {
        let m = BlockManager::new(Config::new(8, 2)).unwrap();
        let (b, digest) = corrupted(&m);
        let pairs = if batch {
            m.append_batch(&[1], &[4]).unwrap().unwrap()
        } else {
            m.append(1, &[4]).unwrap().unwrap()
        };
        assert_eq!(pairs.len(), 1, "batch {batch}: {pairs:?}");
        assert_eq!(pairs[0].0, b);
        let table = m.block_table(1).unwrap();
        assert_eq!(table[1], pairs[0].1, "the write goes to the copy");
        // The hashed block keeps its content: CACHED under the digest it had.
        assert!(m.gpu.index_holds(b, &digest));
        assert_eq!(m.gpu.state(b).load().rc(), 0);
        m.check_invariants().unwrap();
    }
}

#[test]
fn extending_into_a_hashed_partial_block_copies_it() {
    let m = BlockManager::new(Config::new(8, 2)).unwrap();
    m.allocate_chunk(1, &[1, 2, 3, 4], None, None, 3, 0)
        .unwrap()
        .unwrap();
    let b = m.block_table(1).unwrap()[1];
    let digest = Digest::from_words([7, 7, 7, 7], m.hasher.root().as_bytes().len());
    assert!(m
        .gpu
        .register(b, digest, None, || KvEvent::AllBlocksCleared));
    assert!(violation(&m).contains("hashed block"));
    let pairs = m.extend(1, 1, 0).unwrap().unwrap();
    assert_eq!(pairs.len(), 1, "{pairs:?}");
    assert_eq!(pairs[0].0, b);
    assert!(m.gpu.index_holds(b, &digest));
}

#[test]
fn with_groups_a_write_into_a_hashed_partial_block_copies_it() {
    let m = BlockManager::with_groups(
        Config::new(12, 2),
        vec![GroupKind::Full, GroupKind::SlidingWindow { window: 8 }],
    )
    .unwrap();
    m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
    let b = m.block_table_of(1, 1).unwrap()[1];
    let digest = Digest::from_words([7, 7, 7, 7], m.hasher.root().as_bytes().len()).keyed(1);
    assert!(m
        .gpu
        .register(b, digest, None, || KvEvent::AllBlocksCleared));
    assert!(violation(&m).contains("hashed block"));
    let pairs = m.append(1, &[4]).unwrap().unwrap();
    assert_eq!(pairs.len(), 1, "{pairs:?}");
    assert_eq!(pairs[0].0, b);
    assert!(m.gpu.index_holds(b, &digest));
    m.check_invariants().unwrap();
}

#[test]
fn truncating_to_a_hashed_partial_block_held_alone_withdraws_it() {
    // Through the API: registered while full, then left partial by a truncate.
    let m = BlockManager::new(Config::new(8, 2)).unwrap();
    m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
        .unwrap()
        .unwrap();
    let b = m.block_table(1).unwrap()[1];
    assert!(m.gpu.state(b).load().hashed());
    assert_eq!(m.truncate(1, 3).unwrap().unwrap(), vec![]);
    assert!(!m.gpu.state(b).load().hashed(), "withdrawn, not copied");
    let seq = lock(&m.seqs.get(1).unwrap().seq).clone();
    assert_eq!(seq.blocks[1], b);
    m.check_invariants().unwrap();
}
