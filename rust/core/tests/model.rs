//! Model-based test: random operation sequences (allocate with shared prefixes and salts,
//! append, batch append, fork, free, batch free, swap out and in, reset) against the model of
//! block contents in `support/ops.rs`, with `check_invariants` after every step. Proptest
//! shrinks a failure to a minimal sequence of operations.
#![cfg(not(loom))]

#[path = "support/ops.rs"]
mod ops;

use proptest::prelude::*;

fn program() -> impl Strategy<Value = (ops::Setup, Vec<ops::Op>)> {
    (
        any::<[u8; 4]>().prop_map(ops::Setup::decode),
        proptest::collection::vec(any::<[u8; 4]>().prop_map(ops::Op::decode), 1..160),
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_the_content_model((setup, ops) in program()) {
        ops::run(&setup, &ops);
    }
}

/// The generator is not toothless: over many programs, calls succeed, are refused, fail,
/// and prefix hits happen (including under the colliding test hash).
#[test]
fn programs_exercise_hits_refusals_and_errors() {
    let mut total = ops::Report::default();
    let mut collide_hits = 0;
    for seed in 0..300u32 {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let bytes: Vec<u8> = (0..4 + 4 * 120)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        let (setup, _) = ops::decode(&bytes);
        let r = ops::run_bytes(&bytes);
        total.steps += r.steps;
        total.refused += r.refused;
        total.errors += r.errors;
        total.hit_tokens += r.hit_tokens;
        if setup.algo == pagedkv_core::HashAlgo::Xxh3Trunc8 {
            collide_hits += r.hit_tokens;
        }
    }
    assert_eq!(total.steps, 300 * 120);
    assert!(total.refused > 1000 && total.errors > 1000, "{total:?}");
    assert!(
        total.hit_tokens > 1000 && collide_hits > 100,
        "{total:?} {collide_hits}"
    );
}
