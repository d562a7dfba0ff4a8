//! Times a compact snapshot of 1 M blocks applied inside Rust (no Python, no socket): into a
//! fresh index, and replacing 1 M other blocks the engine held; split into staging (the
//! parts applied beside the engine's blocks) and commit (the swap: `commit_snapshot_deferred`),
//! then the replaced blocks dropped (`drop_replaced`, what the binding runs on another thread). `cargo run --release -p pagedkv-router --example snapshot -- [blocks] [rounds] [fresh|replacing]`.

use pagedkv_router::{compact, EngineKey, RouterIndex};
use std::time::{Duration, Instant};

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The parts a publisher sends for `n` blocks: 2 MiB of keys a part.
fn parts(n: u64, salt: u64) -> Vec<Vec<u8>> {
    let keys: Vec<u64> = (0..n).map(|i| mix(i + salt)).collect();
    keys.chunks(1 << 18)
        .map(|c| compact::encode(Some("GPU"), 0, c))
        .collect()
}

/// This thread's CPU time: on a machine shared with other jobs, steadier than the wall clock
/// (the wall time counts the moments another job had the core).
fn cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; the clock id is a constant the call knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// (staging, commit, CPU time of both) of one snapshot.
fn apply(ix: &RouterIndex<u64>, parts: &[Vec<u8>]) -> (Duration, Duration, Duration) {
    let e = EngineKey::from("e");
    let c0 = cpu();
    let t = Instant::now();
    ix.begin_snapshot(&e);
    for p in parts {
        ix.apply_staged_payload(&e, p).unwrap();
    }
    let staged = t.elapsed();
    let t = Instant::now();
    ix.commit_snapshot_deferred(&e).unwrap();
    (staged, t.elapsed(), cpu() - c0)
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(1_000_000, |v| v.parse().unwrap());
    let rounds: usize = std::env::args().nth(2).map_or(5, |v| v.parse().unwrap());
    // "fresh" or "replacing" alone (to profile one), or both.
    let only = std::env::args().nth(3);
    let new = parts(n, 0);
    let old = parts(n, 1 << 40);
    for over in ["fresh", "replacing"] {
        if only.as_deref().is_some_and(|o| o != over) {
            continue;
        }
        let mut runs = Vec::new();
        for _ in 0..rounds {
            let ix = RouterIndex::<u64>::default();
            if over == "replacing" {
                apply(&ix, &old);
            }
            let (s, c, used) = apply(&ix, &new);
            let t = Instant::now();
            ix.drop_replaced();
            let dropping = t.elapsed();
            assert_eq!(ix.stats().memberships, n);
            runs.push((s + c, s, c, dropping, used));
            let t = Instant::now();
            drop(ix);
            let dropped = t.elapsed();
            println!(
                "{over}: applied {:.1} ms (staging {:.1}, commit {:.1}; CPU {:.1}); old blocks dropped in {:.1} ms more; index dropped in {:.1} ms",
                (s + c).as_secs_f64() * 1e3,
                s.as_secs_f64() * 1e3,
                c.as_secs_f64() * 1e3,
                used.as_secs_f64() * 1e3,
                dropping.as_secs_f64() * 1e3,
                dropped.as_secs_f64() * 1e3
            );
        }
        runs.sort();
        let m = runs[runs.len() / 2];
        let mut used: Vec<Duration> = runs.iter().map(|r| r.4).collect();
        used.sort();
        println!(
            "{over}: median applied {:.1} ms (staging {:.1}, commit {:.1}; then dropping {:.1}); median CPU {:.1} ms",
            m.0.as_secs_f64() * 1e3,
            m.1.as_secs_f64() * 1e3,
            m.2.as_secs_f64() * 1e3,
            m.3.as_secs_f64() * 1e3,
            used[used.len() / 2].as_secs_f64() * 1e3
        );
    }
}
