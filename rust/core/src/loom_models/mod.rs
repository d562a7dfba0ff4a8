//! Loom models of the atomic protocols: every interleaving of two or three threads (within a
//! preemption bound where noted), under the C11 memory model. Run:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv-core --release
//! --lib loom_models`. The list, by protocol, is in docs/concurrency.md; each pool-level model
//! ends with the full pool audit (`BlockPool::audit`), so "the loser sees a consistent state"
//! is checked, not assumed. Where a model exists for one rare interleaving, it also records
//! which outcomes it saw and fails unless that interleaving was explored.
//!
//! One file per protocol: `free_stack`, `block_state` (the state word), `release` (admission
//! and release to the pool), `hits` (pin, then compare the digest), `retraction`,
//! `prefix_index` (slots and stripes), `lru_queue`, `pins` (never-evicted blocks), `gate`
//! (the reset gate), `withdraw`
//! (`evict_blocks`), `snapshot` (a KV event snapshot between two events), `tenants` (a
//! tenant's removal from the registry against refs in flight). This file holds
//! the fixture they share: pools in a known start state, a digest per token, `pin`, `model`
//! and `Seen`.

mod block_state;
mod free_stack;
mod gate;
mod hits;
mod lru_queue;
mod pins;
mod prefix_index;
mod release;
mod retraction;
mod snapshot;
mod tenants;
mod withdraw;

use crate::block_pool::{BlockPool, Hit};
use crate::events::KvEvent;
use crate::eviction_order::{plain::PlainLru, EvictionOrder};
use crate::hashing::{BlockHasher, Digest, HashAlgo};
use loom::sync::Arc;

fn digest(token: u32) -> Digest {
    let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
    h.hash_block(&h.root(), &[token], &[0])
}

/// A pool of `n` blocks whose block 0 is OWNED by `holders` tables and, with `digest`,
/// registered (hashed) under it.
fn pool_with_owned_block(n: u32, holders: u32, digest: Option<Digest>) -> Arc<BlockPool> {
    owned_block(false, n, holders, digest)
}

/// `pool_with_owned_block` for a pool whose eviction policy runs in locked mode
/// (`eviction_order`, with the plainest policy) when `locked`, else lock-free LRU. The
/// models of a protocol that locked mode changes run both ways.
fn owned_block(locked: bool, n: u32, holders: u32, digest: Option<Digest>) -> Arc<BlockPool> {
    let mut pool = BlockPool::new(n, false, false).unwrap();
    if locked {
        pool = pool.with_order(EvictionOrder::locked(Box::<PlainLru>::default()));
    }
    owned_block_in(pool, holders, digest)
}

fn owned_block_in(pool: BlockPool, holders: u32, digest: Option<Digest>) -> Arc<BlockPool> {
    let pool = Arc::new(pool);
    assert!(pool.reserve(1));
    let b = pool.take();
    assert_eq!(b, 0);
    (1..holders).for_each(|_| pool.state(b).share().unwrap());
    if let Some(d) = digest {
        assert!(pool.register(b, d, None, || unreachable!()));
    }
    pool
}

/// A pool of `n` blocks, all OWNED by one table each (taken in order `0..n`), with events
/// when `events`.
fn pool_all_owned(n: u32, events: bool) -> Arc<BlockPool> {
    let pool = Arc::new(BlockPool::new(n, events, false).unwrap());
    assert!(pool.reserve(n as usize));
    for b in 0..n {
        assert_eq!(pool.take(), b);
    }
    pool
}

fn stored(d: Digest) -> KvEvent {
    KvEvent::BlockStored {
        block_hash: d,
        parent_block_hash: None,
        token_ids: Vec::new().into(),
        lora_id: None,
        medium: crate::events::Medium::Gpu,
        group: 0,
    }
}

/// Apply `events`, all about digest `d`, to "is `d` cached" starting from `held`, as an
/// indexer would, requiring each to change what it names (no store of a block already
/// held, no removal of one not held); returns the final answer.
fn replay_one_digest(events: Vec<KvEvent>, d: Digest, mut held: bool) -> bool {
    for e in events {
        match e {
            KvEvent::BlockStored { block_hash, .. } => {
                assert_eq!(block_hash, d);
                assert!(!held, "stored while already held");
                held = true;
            }
            KvEvent::BlockRemoved { block_hash, .. } => {
                assert_eq!(block_hash, d);
                assert!(held, "removed while not held");
                held = false;
            }
            KvEvent::AllBlocksCleared => panic!("no reset here"),
        }
    }
    held
}

/// A prefix hit by a caller that reserved nothing. A unit that `pin` reserved for a revival
/// that then did not happen (the block went stale meanwhile) comes back in `spare`; the
/// caller returns it, as `take_prompt_blocks` does, and the audit checks `available`.
fn pin(pool: &BlockPool, d: &Digest) -> Hit {
    let mut spare = 0;
    let hit = pool.pin(d, None, &mut spare).unwrap();
    assert!(spare <= 1, "at most the one unit reserved here");
    pool.unreserve(spare);
    hit
}

/// Explore `f` with loom. `bound`: the preemption bound (None: every interleaving), for the
/// models whose full space would take too long. The branch limit is raised because some
/// models build their start state (dozens of releases) inside the model, where loom counts
/// every atomic step as a branch even with one thread running.
fn model(bound: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if bound.is_some() {
        b.preemption_bound = bound;
    }
    b.max_branches = 20_000;
    b.check(f);
}

/// Outcomes a model saw across its interleavings (std atomics: outside the model).
#[derive(Clone, Default)]
struct Seen(std::sync::Arc<std::sync::atomic::AtomicU32>);

impl Seen {
    fn saw(&self, outcome: u32) {
        self.0
            .fetch_or(1 << outcome, std::sync::atomic::Ordering::Relaxed);
    }
    fn assert_saw(&self, outcomes: &[u32]) {
        let seen = self.0.load(std::sync::atomic::Ordering::Relaxed);
        for &o in outcomes {
            assert!(seen & (1 << o) != 0, "outcome {o} never explored");
        }
    }
}
