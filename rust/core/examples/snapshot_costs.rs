//! Issue 32, item 11: `kv_event_snapshot` of 1 Mi cached blocks in the core alone (no Python),
//! while a second thread registers and evicts.
//!
//! A manager of 1 Mi + 64 blocks of 16 tokens, events on (unbounded queue), caches 1 Mi
//! blocks (16,384 prompts of 64 blocks, drained). Then:
//! - `snapshot`: the call's time and the bytes it allocates (peak above the start, and what
//!   its result keeps), best and worst of `ROUNDS` snapshots;
//! - `churn`: a second thread allocates and frees 1-block prompts of new content on the full
//!   pool (each allocate registers a block and evicts one), recording the time of each call,
//!   while the main thread takes snapshots back to back; the same thread alone first. The
//!   worst call time with snapshots against without is the wait the snapshots caused.
//!
//! - the longest holds of the event log's lock (feature `lock-timing`) by a push and by a
//!   snapshot: the most any registration or eviction could wait for it.
//!
//! `cargo run --release -p pagedkv-core --features lock-timing --example snapshot_costs
//! [blocks]` (default 1 Mi).

use pagedkv_core::{BlockManager, Config};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes allocated and not freed, and the peak since the last reset.
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call forwards to the system allocator with the caller's layout; the
// counters are tallies beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Relaxed: tallies.
        let now =
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed) + layout.size() as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const B: usize = 16;
const ROUNDS: usize = 5;

fn churn(m: &BlockManager, stop: &AtomicBool, first: u32) -> (usize, Duration, Vec<Duration>) {
    let mut times = Vec::new();
    let mut t = first;
    while !stop.load(Ordering::Relaxed) {
        let prompt: Vec<u32> = (0..B as u32 + 1).map(|i| t * 100 + i).collect();
        t += 1;
        let start = Instant::now();
        m.allocate(u64::from(t), &prompt, None, None, 0)
            .unwrap()
            .unwrap();
        m.free(u64::from(t)).unwrap();
        times.push(start.elapsed());
        if times.len() % 4096 == 0 {
            m.drain_events().unwrap();
        }
    }
    times.sort_unstable();
    let worst = *times.last().unwrap();
    (times.len(), worst, times)
}

fn pct(times: &[Duration], p: f64) -> Duration {
    times[((times.len() - 1) as f64 * p) as usize]
}

fn main() {
    let blocks: usize = std::env::args()
        .nth(1)
        .map_or(1 << 20, |a| a.parse().expect("a block count"));
    let mut c = Config::new((blocks + 64) as u32, B);
    c.enable_kv_events = true;
    let m = Arc::new(BlockManager::new(c).unwrap());
    m.set_kv_event_capacity(None).unwrap();
    let t0 = Instant::now();
    for i in 0..blocks / 64 {
        let prompt: Vec<u32> = (0..64 * B as u32 + 1)
            .map(|t| (i as u32) * 10_000 + t)
            .collect();
        m.allocate(i as u64, &prompt, None, None, 0)
            .unwrap()
            .unwrap();
        m.free(i as u64).unwrap();
        if i % 1024 == 0 {
            m.drain_events().unwrap();
        }
    }
    m.drain_events().unwrap();
    m.take_kv_event_lock_holds().unwrap();
    println!(
        "{} cached blocks of {B} tokens, events on (built in {:.1?})",
        m.stats().cached_blocks,
        t0.elapsed()
    );

    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let start = Instant::now();
        let snap = m.kv_event_snapshot().unwrap();
        let took = start.elapsed();
        let peak = PEAK.load(Ordering::Relaxed) - before;
        let kept = LIVE.load(Ordering::Relaxed) - before;
        assert_eq!(snap.len(), m.stats().cached_blocks);
        drop(snap);
        times.push((took, peak, kept));
    }
    let best = times.iter().min_by_key(|t| t.0).unwrap();
    let worst = times.iter().max_by_key(|t| t.0).unwrap();
    println!(
        "snapshot: best {:.1?} (peak {:.1} MB, result {:.1} MB), worst {:.1?} of {ROUNDS}",
        best.0,
        best.1 as f64 / 1e6,
        best.2 as f64 / 1e6,
        worst.0
    );

    let mut idle = m.take_kv_event_lock_holds().unwrap().snapshots;
    idle.sort_unstable();
    println!(
        "  of which under the event lock: median {:.1?}, worst {:.1?}",
        pct(&idle, 0.5),
        idle[idle.len() - 1]
    );

    // The second thread alone, then beside back-to-back snapshots.
    for with_snapshots in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let worker = {
            let (m, stop) = (m.clone(), stop.clone());
            let first = if with_snapshots { 2_000_000 } else { 1_000_000 };
            std::thread::spawn(move || churn(&m, &stop, first))
        };
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until {
            if with_snapshots {
                let snap = m.kv_event_snapshot().unwrap();
                assert!(!snap.is_empty());
            } else {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        stop.store(true, Ordering::Relaxed);
        let (calls, worst, times) = worker.join().unwrap();
        let holds = m.take_kv_event_lock_holds().unwrap();
        let mut snaps = holds.snapshots.clone();
        snaps.sort_unstable();
        let snap_holds = if snaps.is_empty() {
            String::new()
        } else {
            format!(
                "; a snapshot held it: median {:.1?}, worst {:.1?}, over 100 us {} of {}",
                pct(&snaps, 0.5),
                snaps[snaps.len() - 1],
                snaps.iter().filter(|d| d.as_micros() > 100).count(),
                snaps.len()
            )
        };
        println!(
            "churn {}: {calls} allocate+free calls (each registers and evicts a block), \
             median {:.1?}, p99.9 {:.1?}, worst {:.1?}; a push held the event lock over \
             100 us {} times in {}, at most {:.1?}; of those pushes {} copied a chunk a \
             snapshot held, {} of them over 100 us, at most {:.1?}{snap_holds}",
            if with_snapshots {
                "beside back-to-back snapshots"
            } else {
                "alone"
            },
            pct(&times, 0.5),
            pct(&times, 0.999),
            worst,
            holds.pushes_over_100us,
            holds.pushes,
            holds.push_max,
            holds.copying,
            holds.copying_over_100us,
            holds.copying_max,
        );
    }
}
