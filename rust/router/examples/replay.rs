//! Replays a dumped event stream into the index and times lookups inside Rust (no Python):
//! `python benches/router_dump.py OUT` writes the file; then
//! `cargo run --release -p pagedkv-router --example replay -- OUT [threads] [passes]`
//! (passes over the lookups, 5 by default: more to profile the walk alone).
//!
//! File: a sequence of records, each `u8 kind` then: kind 1, `u64 engine, u32 len, payload`
//! (a vLLM `KVEventBatch`); kind 2, `u32 n, n x u64` (a lookup's block hashes).

use pagedkv_router::{EngineKey, RawHit, RouterIndex};
use std::time::Instant;

fn u32_at(b: &[u8], i: &mut usize) -> u32 {
    let v = u32::from_le_bytes(b[*i..*i + 4].try_into().unwrap());
    *i += 4;
    v
}

fn u64_at(b: &[u8], i: &mut usize) -> u64 {
    let v = u64::from_le_bytes(b[*i..*i + 8].try_into().unwrap());
    *i += 8;
    v
}

fn main() {
    let path = std::env::args().nth(1).expect("a dump file");
    let threads: usize = std::env::args().nth(2).map_or(1, |t| t.parse().unwrap());
    let passes: usize = std::env::args().nth(3).map_or(5, |t| t.parse().unwrap());
    let bytes = std::fs::read(path).unwrap();
    let (mut payloads, mut lookups) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < bytes.len() {
        let kind = bytes[i];
        i += 1;
        if kind == 1 {
            let e = u64_at(&bytes, &mut i);
            let n = u32_at(&bytes, &mut i) as usize;
            payloads.push((EngineKey::Int(e), &bytes[i..i + n]));
            i += n;
        } else {
            let n = u32_at(&bytes, &mut i) as usize;
            lookups.push((0..n).map(|_| u64_at(&bytes, &mut i)).collect::<Vec<u64>>());
        }
    }
    let ix = RouterIndex::<u64>::default();
    let t = Instant::now();
    let mut ops = 0u64;
    for (e, p) in &payloads {
        let a = ix.apply_payload(e, p).unwrap();
        ops += a.stored + a.removed;
    }
    let dt = t.elapsed();
    println!(
        "apply: {} payloads, {ops} block ops in {dt:?}: {:.2} M ops/s",
        payloads.len(),
        ops as f64 / dt.as_secs_f64() / 1e6
    );
    let s = ix.stats();
    println!(
        "memberships {}, entries {}, {:.1} bytes per membership (own accounting)",
        s.memberships,
        s.entries,
        s.bytes() as f64 / s.memberships as f64
    );
    // What the process holds, and how much of it in transparent huge pages (Linux).
    if let Ok(r) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        let kb = |name: &str| {
            r.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .unwrap_or("?")
                .to_string()
        };
        println!(
            "process: Rss {} kB, AnonHugePages {} kB",
            kb("Rss:"),
            kb("AnonHugePages:")
        );
    }
    let run = |ix: &RouterIndex<u64>| {
        let mut out: Vec<RawHit> = Vec::new();
        let mut lat = Vec::with_capacity(lookups.len() * passes);
        for _ in 0..passes {
            for q in &lookups {
                let t = Instant::now();
                ix.match_raw(q, &mut out);
                lat.push(t.elapsed().as_nanos() as u64);
            }
        }
        lat
    };
    let mut lat: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| run(&ix))).collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    lat.sort_unstable();
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] as f64 / 1000.0;
    println!(
        "lookups ({threads} threads): {} timed, p50 {:.2} us, p90 {:.2} us, p99 {:.2} us, max {:.2} us",
        lat.len(),
        q(0.5),
        q(0.9),
        q(0.99),
        *lat.last().unwrap() as f64 / 1000.0
    );
}
