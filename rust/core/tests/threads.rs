//! Many threads on one manager: shared prefixes, constant eviction, forks, swaps and batch
//! steps; afterwards every block is accounted for and every sequence holds what its thread
//! wrote.
#![cfg(not(loom))]

use pagedkv_core::{encode_extras, BlockHasher, BlockManager, Config, HashAlgo};
use std::sync::Arc;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

fn worker(m: &BlockManager, thread: u64, ops: usize) -> Vec<(u64, Vec<u32>)> {
    let mut rng = Rng(0x9e37_79b9 + thread);
    let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut next_id = thread << 32;
    for _ in 0..ops {
        match rng.below(10) {
            0..=2 => {
                // A prompt sharing one of a few system prefixes with other threads.
                let mut prompt: Vec<u32> = (0..8 * (1 + rng.below(3) as u32)).collect();
                prompt.extend((0..1 + rng.below(12)).map(|_| rng.below(50) as u32));
                next_id += 1;
                if m.allocate(next_id, &prompt, None, None, 0)
                    .unwrap()
                    .is_some()
                {
                    live.push((next_id, prompt));
                }
            }
            3..=5 if !live.is_empty() => {
                let ids: Vec<u64> = live.iter().map(|s| s.0).collect();
                let toks: Vec<u32> = ids.iter().map(|_| rng.below(50) as u32).collect();
                if m.append_batch(&ids, &toks).unwrap().is_some() {
                    live.iter_mut().zip(&toks).for_each(|(s, &t)| s.1.push(t));
                }
            }
            6 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                next_id += 1;
                m.fork(live[i].0, next_id).unwrap();
                let tokens = live[i].1.clone();
                live.push((next_id, tokens));
            }
            7 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let id = live[i].0;
                if m.swap_out(id).unwrap().is_some() {
                    let back = m.swap_in(id).unwrap();
                    if back.is_none() {
                        m.free(id).unwrap();
                        live.swap_remove(i);
                    }
                }
            }
            _ if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                m.free(live.swap_remove(i).0).unwrap();
            }
            _ => {}
        }
    }
    live
}

#[test]
fn threads_lose_nothing() {
    let mut config = Config::new(96, 4);
    config.num_cpu_blocks = 32;
    let m = Arc::new(BlockManager::new(config).unwrap());
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let m = m.clone();
            std::thread::spawn(move || worker(&m, t, 3000))
        })
        .collect();
    let survivors: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    m.check_invariants().unwrap();
    assert_eq!(m.num_sequences(), survivors.len());
    let hasher = BlockHasher::new(HashAlgo::Sha256, 0);
    for (id, tokens) in &survivors {
        assert_eq!(m.num_tokens(*id).unwrap(), tokens.len(), "sequence {id}");
        let expected = hasher.hash_chain(tokens, 4, &encode_extras(None, None));
        assert_eq!(
            m.block_hashes(*id).unwrap(),
            expected,
            "sequence {id} content"
        );
    }
    let s = m.stats();
    assert_eq!(s.free_blocks + s.used_blocks + s.cached_blocks, 96);
    assert!(
        s.evictions > 0 && s.prefix_hits > 0,
        "the workload must evict and hit: {s:?}"
    );
    let ids: Vec<u64> = survivors.iter().map(|s| s.0).collect();
    m.free_batch(&ids).unwrap();
    assert_eq!(m.num_free_blocks() + m.num_cached_blocks(), 96);
    m.check_invariants().unwrap();
}

/// `fork(2 -> 1)` racing a batch call over `[1, 2]` (which locks 1 first) while a third thread
/// creates and frees id 1. Fork once held the parent (2) while it waited for a pending or
/// dying cell of 1, and the batch, holding that cell of 1, waited for 2: a deadlock. A
/// watchdog turns a hang into a failure.
#[test]
fn fork_racing_a_batch_and_the_childs_creation_never_deadlocks() {
    use pagedkv_core::Error;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let m = Arc::new(BlockManager::new(Config::new(256, 4)).unwrap());
    let (parent, child) = (2u64, 1u64);
    m.allocate(parent, &(0..9).collect::<Vec<u32>>(), None, None, 0)
        .unwrap()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(3);
    let spawn = |f: Box<dyn Fn(&BlockManager) + Send>| {
        let (m, stop) = (m.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            // Relaxed: a stop flag; nothing is published through it.
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                f(&m);
                rounds += 1;
            }
            rounds
        })
    };
    let prompt: Vec<u32> = (100..228).collect();
    let threads = vec![
        spawn(Box::new(move |m| match m.fork(parent, child) {
            Ok(()) => m.free(child).unwrap_or(()),
            Err(Error::DuplicateSequence(_)) => {}
            Err(e) => panic!("fork: {e:?}"),
        })),
        spawn(Box::new(move |m| {
            if let Ok(Some(_)) = m.allocate(child, &prompt, None, None, 0) {
                let _ = m.free(child);
            }
        })),
        spawn(Box::new(move |m| {
            let _ = m.block_tables(&[child, parent], -1);
        })),
        spawn(Box::new(move |m| {
            let _ = m.append_batch(&[child, parent], &[1, 1]);
        })),
    ];
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rounds: Vec<u64> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        let _ = tx.send(rounds);
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(rounds) => assert!(rounds.iter().all(|&r| r > 0), "{rounds:?}"),
        Err(_) => {
            stop.store(true, Ordering::Relaxed);
            panic!("deadlock: fork, the batch calls and the child's creator stopped");
        }
    }
}
