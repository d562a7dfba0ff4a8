//! Issue 13's per-operation costs in the core alone (no Python), for one long prompt of
//! 8,197 tokens (512 full blocks of 16 and one partial), SHA-256:
//! - hash: `BlockHasher::hash_chain` of the prompt, the hashing every allocate does;
//! - allocate miss (free pool), hit (every full block cached), and miss under a full cache
//!   (each new block evicts the oldest cached one), in ns per prompt token;
//! - free of the 513-block sequence, in ns per block.
//!
//! Each figure is the best of `ROUNDS` (the machine is shared; noise only adds time). Setup
//! between rounds (a fresh prompt, a reset, a free) is untimed.
//! `cargo run --release -p pagedkv-core --example op_costs`

use pagedkv_core::{BlockHasher, BlockManager, Config, HashAlgo};
use std::time::{Duration, Instant};

const B: usize = 16;
const LEN: usize = 512 * B + 5;
const ROUNDS: u32 = 300;

fn main() {
    let mut seed = 13u64;
    let mut prompt = || -> Vec<u32> {
        (0..LEN)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % 128_000) as u32
            })
            .collect()
    };
    let hasher = BlockHasher::new(HashAlgo::Sha256, 0);
    let p = prompt();
    let hash = best(|| {
        let t = Instant::now();
        std::hint::black_box(hasher.hash_chain(&p, B, &[]));
        t.elapsed()
    });
    report("hash_chain (SHA-256)", hash, LEN, "token");

    // Miss into free blocks: the cache is emptied before each round.
    let m = BlockManager::new(Config::new(4096, B)).unwrap();
    let miss = best(|| {
        let tokens = prompt();
        let _ = m.free(1);
        m.reset_prefix_cache().unwrap();
        let t = Instant::now();
        m.allocate_owned(1, tokens, None, None, 0).unwrap().unwrap();
        t.elapsed()
    });
    report("allocate miss (free pool)", miss, LEN, "token");

    // Hit: the same prompt again after its sequence was freed (512 blocks cached).
    m.free(1).unwrap();
    m.allocate(1, &p, None, None, 0).unwrap().unwrap();
    let hit = best(|| {
        let tokens = p.clone();
        let _ = m.free(1);
        let t = Instant::now();
        assert_eq!(
            m.allocate_owned(1, tokens, None, None, 0).unwrap(),
            Some(512 * B)
        );
        t.elapsed()
    });
    report("allocate hit (512 blocks cached)", hit, LEN, "token");

    // Miss under a full cache: every block CACHED, so each new block evicts one.
    let m = BlockManager::new(Config::new(2048, B)).unwrap();
    let filler: Vec<u32> = (0..2048 * B as u32).collect();
    m.allocate(0, &filler, None, None, 0).unwrap().unwrap();
    m.free(0).unwrap();
    let evict = best(|| {
        let tokens = prompt();
        let _ = m.free(1);
        let t = Instant::now();
        m.allocate_owned(1, tokens, None, None, 0).unwrap().unwrap();
        t.elapsed()
    });
    report("allocate miss, evicting (full cache)", evict, LEN, "token");

    let free = best(|| {
        if m.num_sequences() == 0 {
            m.allocate(1, &p, None, None, 0).unwrap().unwrap();
        }
        let t = Instant::now();
        m.free(1).unwrap();
        t.elapsed()
    });
    report("free (513 blocks)", free, LEN.div_ceil(B), "block");
    m.check_invariants().unwrap();
}

fn best(mut round: impl FnMut() -> Duration) -> Duration {
    (0..ROUNDS).map(|_| round()).min().unwrap()
}

fn report(what: &str, d: Duration, units: usize, unit: &str) {
    let ns = d.as_secs_f64() * 1e9;
    println!(
        "{what:<38} {:>9.2} us  {:>7.2} ns/{unit}",
        ns / 1e3,
        ns / units as f64
    );
}
