//! Fuzz the block manager with operation sequences: every step is checked against the content
//! model and `check_invariants` (see `rust/core/tests/support/ops.rs`, shared with the stable
//! corpus replay and the proptest model test).
#![no_main]

#[path = "../../rust/core/tests/support/ops.rs"]
mod ops;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ops::run_bytes(data);
});
