//! Loom models of the router's concurrency protocols: every interleaving of two or three
//! threads (within a preemption bound where noted) under loom's model of C11, running the
//! crate's own code: `slots.rs` and `replaced.rs` take their atomics and locks from `sync.rs`,
//! which names loom's under `--cfg loom`. Run:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom-router cargo test -p pagedkv-router
//! --release --lib --locked loom_models` (`.ci/lane-router-loom.sh`). The list is in
//! docs/concurrency.md, beside the core's.
//!
//! One file per protocol: `replaced` (a writer short of slots and a drop of replaced holders
//! in flight: `Replaced::alloc_with`, as `RouterIndex::alloc_slot` runs it) and `lookup_word`
//! (a lookup's read of one word of holders under its generation, `word_read::read_word`,
//! against a commit and against a slot's reuse). This file holds what they share: `model`
//! and `Seen`.

mod lookup_word;
mod replaced;

/// Explore `f` with loom. `bound`: the preemption bound (None: every interleaving), for the
/// models whose full space would take too long.
fn model(bound: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if bound.is_some() {
        b.preemption_bound = bound;
    }
    b.check(f);
}

/// Outcomes a model saw across its interleavings (std atomics: outside the model, so they add
/// no interleavings of their own). A model aimed at a rare interleaving fails unless loom
/// explored it.
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
