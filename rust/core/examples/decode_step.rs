//! Times one scheduler decode step (one token to each of 256 sequences) in the core alone,
//! in the shape of the Python benchmark: prompts of 100..355 tokens, so 16 sequences cross a
//! block boundary each step; every 64 steps the batch is freed and allocated again. Reports
//! the best 64-step cycle per step.
//! `cargo run --release -p pagedkv-core --example decode_step`

use pagedkv_core::{BlockManager, Config};
use std::time::{Duration, Instant};

#[path = "support/prompts.rs"]
mod prompts;

fn main() {
    for caching in [true, false] {
        for running in [false, true] {
            let per = run(caching, running);
            let call = if running {
                "RunningBatch step"
            } else {
                "append_batch"
            };
            println!("{call} of 256 (prefix caching {caching}): {per:.2} us per step");
        }
    }
}

/// `running`: the step is a `RunningBatch`'s (members resolved once per cycle, slots
/// returned) rather than `append_batch`'s.
fn run(caching: bool, running: bool) -> f64 {
    let mut config = Config::new(8192, 16);
    config.enable_prefix_caching = caching;
    let m = BlockManager::new(config).unwrap();
    let ids: Vec<u64> = (0..256).collect();
    let prompts = prompts::decode_prompts(&ids);
    let toks = vec![7u32; 256];
    // The best cycle of 64 steps: the machine is shared, and noise only ever adds time.
    let mut best = Duration::MAX;
    for _ in 0..200 {
        if m.num_sequences() > 0 {
            m.free_batch(&ids).unwrap();
        }
        for (&id, p) in ids.iter().zip(&prompts) {
            m.allocate(id, p, None, None, 0).unwrap().unwrap();
        }
        let batch = m.running_batch();
        m.batch_add(&batch, &ids).unwrap();
        let t = Instant::now();
        for _ in 0..64 {
            if running {
                m.batch_step(&batch, &toks).unwrap().unwrap();
            } else {
                m.append_batch(&ids, &toks).unwrap().unwrap();
            }
        }
        best = best.min(t.elapsed());
    }
    m.check_invariants().unwrap();
    best.as_secs_f64() / 64.0 * 1e6
}
