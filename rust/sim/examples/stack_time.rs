//! Times `stack::thresholds` on a synthetic stream the size of a full-trace curve run:
//! `cargo run --release -p pagedkv-sim --example stack_time`.
use pagedkv_sim::block_keys::finish;
use pagedkv_sim::stack::{thresholds, Piece};
use std::time::Instant;

fn main() {
    let mut keys = Vec::new();
    let mut pieces = Vec::new();
    let mut x = 1u64;
    let mut rnd = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        x >> 11
    };
    let distinct = 5_000_000u64;
    while keys.len() < 14_000_000 {
        let lookup = rnd() % 3 == 0;
        let len = (rnd() % 200) as usize;
        let base = rnd() % distinct;
        for i in 0..len as u64 {
            keys.push(finish((base + i) % distinct));
        }
        pieces.push(Piece {
            end: keys.len(),
            lookup,
        });
    }
    let t = Instant::now();
    let out = thresholds(&keys, &pieces, 1.0, 0);
    println!(
        "{} keys, {} touches, {} distinct, {} thresholds: {:.2} s",
        keys.len(),
        out.touches,
        out.distinct,
        out.values.len(),
        t.elapsed().as_secs_f64()
    );
}
