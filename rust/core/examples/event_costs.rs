//! What recording KV events costs the core alone (no Python): 32 allocations of new
//! 1,041-token prompts into a warm pool of 6,336 blocks (each registers 65 blocks and evicts
//! as many cached ones), then their frees, with events disabled and enabled side by side.
//! About 2,080 `BlockStored` and 2,080 `BlockRemoved` a round; the queue is drained between
//! rounds, untimed. Each figure is the best of `ROUNDS` (the machine is shared).
//! `cargo run --release -p pagedkv-core --example event_costs`

use pagedkv_core::{BlockManager, Config};
use std::time::{Duration, Instant};

const B: usize = 16;
const ROUNDS: usize = 200;

fn best_round(events: bool) -> Duration {
    let mut c = Config::new(3 * 32 * 66, B);
    c.enable_kv_events = events;
    let m = BlockManager::new(c).expect("a valid config");
    let mut seed = 7u64;
    let mut token = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 100_000) as u32
    };
    let mut best = Duration::MAX;
    for _ in 0..ROUNDS {
        let prompts: Vec<Vec<u32>> = (0..32)
            .map(|_| (0..65 * B + 1).map(|_| token()).collect())
            .collect();
        let t = Instant::now();
        for (i, p) in prompts.iter().enumerate() {
            m.allocate(i as u64, p, None, None, 0).expect("fits");
        }
        for i in 0..32 {
            m.free(i).expect("allocated");
        }
        best = best.min(t.elapsed());
        m.drain_events().expect("unbounded: never overflows");
    }
    best
}

fn main() {
    for _ in 0..3 {
        let (off, on) = (best_round(false), best_round(true));
        let per_event = (on.as_secs_f64() - off.as_secs_f64()) / (2.0 * 32.0 * 65.0) * 1e9;
        println!("events off {off:?}  on {on:?}  ({per_event:.0} ns an event)");
    }
}
