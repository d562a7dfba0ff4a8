//! Many threads on one manager: shared prefixes, constant eviction, forks, swaps and batch
//! steps; afterwards every block is accounted for and every sequence holds what its thread
//! wrote.
#![cfg(not(loom))]

use pagedkv_core::{encode_extras, BlockHasher, BlockManager, Config, HashAlgo};
use std::sync::Arc;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

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
