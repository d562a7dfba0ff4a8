//! Digest collisions never serve another prompt's KV. The test hash `Xxh3Trunc8` keeps one
//! byte of each digest, so colliding blocks are found by a short search; the manager must then
//! confirm every hit with its secret tag and refuse the colliding ones.
#![cfg(not(loom))]

use pagedkv_core::{encode_extras, BlockHasher, BlockManager, Config, HashAlgo};

const B: usize = 4;

fn manager() -> BlockManager {
    let mut c = Config::new(64, B);
    c.hash_algo = HashAlgo::Xxh3Trunc8;
    BlockManager::new(c).unwrap()
}

/// A block of B tokens, other than `not`, whose digest under `parent` equals `target`'s.
fn collide(h: &BlockHasher, parent_of_target: &[u32], target: &[u32], not: &[u32]) -> Vec<u32> {
    let extras = encode_extras(None, None);
    let mut with_target = parent_of_target.to_vec();
    with_target.extend_from_slice(target);
    let want = *h.hash_chain(&with_target, B, &extras).last().unwrap();
    (0u32..)
        .map(|k| vec![k, k + 1, k + 2, 7_000 + k])
        .find(|cand| {
            let mut seq = parent_of_target.to_vec();
            seq.extend_from_slice(cand);
            cand != not && cand != target && *h.hash_chain(&seq, B, &extras).last().unwrap() == want
        })
        .unwrap()
}

#[test]
fn a_colliding_first_block_is_not_a_hit() {
    let h = BlockHasher::new(HashAlgo::Xxh3Trunc8, 0);
    let m = manager();
    let a = vec![1, 2, 3, 4];
    let b = collide(&h, &[], &a, &[]);
    m.allocate(1, &[a.clone(), vec![9]].concat(), None, None, 0)
        .unwrap()
        .unwrap();
    let prompt_b = [b.clone(), vec![9]].concat();
    m.allocate(2, &prompt_b, None, None, 0).unwrap().unwrap();
    assert_eq!(
        m.block_hashes(1).unwrap()[0],
        m.block_hashes(2).unwrap()[0],
        "same digest"
    );
    // Without the tag check sequence 2 would have been served sequence 1's block 0.
    assert_ne!(m.block_table(1).unwrap()[0], m.block_table(2).unwrap()[0]);
    // Also from the cache, after sequence 1 is gone.
    m.free(1).unwrap();
    assert_eq!(m.allocate(3, &prompt_b, None, None, 0).unwrap(), Some(0));
    // The genuine content still hits.
    assert_eq!(
        m.allocate(4, &[a, vec![5]].concat(), None, None, 0)
            .unwrap(),
        Some(B)
    );
    m.check_invariants().unwrap();
}

/// The attack a check of the block's own tokens and parent digest would miss: a collision one
/// level up makes the parent digests equal while the parents' contents differ.
#[test]
fn a_collision_in_the_parent_does_not_leak_the_child() {
    let h = BlockHasher::new(HashAlgo::Xxh3Trunc8, 0);
    let m = manager();
    let x2 = vec![1, 2, 3, 4]; // the victim's first block
    let x1 = collide(&h, &[], &x2, &[]); // the attacker's, same digest
    let y = vec![50, 51, 52, 53];
    // The victim's first block is cached; the attacker computes [x1, y] on top of the
    // colliding digest, so its second block is registered under digest(D, y).
    m.allocate(1, &[x2.clone(), vec![0]].concat(), None, None, 0)
        .unwrap()
        .unwrap();
    m.allocate(2, &[x1.clone(), y.clone(), vec![0]].concat(), None, None, 0)
        .unwrap()
        .unwrap();
    let attacker = m.block_table(2).unwrap();
    // The victim asks for [x2, y]: digest chain equal to the attacker's at both levels.
    let victim = [x2, y, vec![0]].concat();
    assert_eq!(
        m.block_hashes(2).unwrap()[..2],
        h.hash_chain(&victim, B, &[0])[..2]
    );
    let hit = m.allocate(3, &victim, None, None, 0).unwrap().unwrap();
    assert_eq!(hit, B, "only the genuine first block is served");
    assert!(!m.block_table(3).unwrap().contains(&attacker[1]));
    m.check_invariants().unwrap();
}
