//! Times one scheduler decode step (one token to each of 256 sequences) in the core alone.
//! `cargo run --release -p pagedkv-core --example decode_step`

use pagedkv_core::{BlockManager, Config};
use std::time::Instant;

fn main() {
    for caching in [true, false] {
        run(caching);
    }
}

fn run(caching: bool) {
    let mut config = Config::new(100_000, 16);
    config.enable_prefix_caching = caching;
    let m = BlockManager::new(config).unwrap();
    let ids: Vec<u64> = (0..256).collect();
    for &id in &ids {
        let prompt: Vec<u32> = (0..100).map(|t| t + id as u32 * 1000).collect();
        m.allocate(id, &prompt, None, None, 0).unwrap().unwrap();
    }
    let toks = vec![1u32; 256];
    let steps = 4000;
    let t = Instant::now();
    for _ in 0..steps {
        m.append_batch(&ids, &toks).unwrap().unwrap();
    }
    let per = t.elapsed().as_secs_f64() / f64::from(steps) * 1e6;
    println!("append_batch of 256 (prefix caching {caching}): {per:.2} us per step");
    m.check_invariants().unwrap();
}
