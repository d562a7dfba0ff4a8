//! The prefix lock and the digest stripe of real digests of every hash length spread over
//! all locks and stripes (a 16-byte digest once left every call on lock 0 and stripe 0).

use crate::block_pool::{stripe_of, STRIPES};
use crate::hashing::{BlockHasher, HashAlgo};
use crate::manager::{prefix_lock_of, PREFIX_LOCKS};
use std::collections::HashSet;

/// The locks and stripes that the first blocks of 4,096 different prompts fall in.
fn spread(algo: HashAlgo) -> (usize, usize) {
    let h = BlockHasher::new(algo, 0);
    let (mut locks, mut stripes) = (HashSet::new(), HashSet::new());
    for p in 0..4096u32 {
        let first = h.hash_block(&h.root(), &[p, p ^ 0x55, 7, 1], &[]);
        assert!(prefix_lock_of(&first) < PREFIX_LOCKS && stripe_of(&first) < STRIPES);
        locks.insert(prefix_lock_of(&first));
        stripes.insert(stripe_of(&first));
    }
    (locks.len(), stripes.len())
}

#[test]
fn xxh3_128_prompts_spread_over_every_lock_and_stripe() {
    // 4,096 uniform draws leave a given one of 256 stripes empty with probability 1e-7.
    assert_eq!(spread(HashAlgo::Xxh3_128), (PREFIX_LOCKS, STRIPES));
}

#[test]
fn sha256_prompts_spread_over_every_lock_and_stripe() {
    assert_eq!(spread(HashAlgo::Sha256), (PREFIX_LOCKS, STRIPES));
}
