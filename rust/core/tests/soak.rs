//! Soak: millions of operations on a few hot blocks, single-threaded, seeded.
//!
//! Release/revive cycles of the same hot prompts (thousands per block: past any narrow stamp
//! or counter field), deep fork trees with copy-on-write appends into the shared tail block
//! and truncations back to the prompt, aborted chunked prefills (scheduled chunk by chunk,
//! then freed with no token computed: a prompt that was not cached must stay uncached, its
//! blocks withdrawn, register/withdraw cycles thousands of times per hot block), and
//! repeated resets. Along the way: `check_invariants` every `AUDIT_EVERY` cycles, and an
//! eviction-order check against a model of the LRU queue: a "flood" (a sequence with no full
//! block, so nothing of it is ever cached) evicts exactly the `k` least recently released hot
//! prompts, and probing every hot prompt must show exactly those `k` gone.
//!
//! Sizes: `PAGEDKV_SOAK_SCALE` (a float, default 1) multiplies the cycle count; the default
//! takes a few seconds in debug mode. See docs/soak.md.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, HashAlgo};

const B: usize = 16;
const NUM_BLOCKS: u32 = 4096;
const AUDIT_EVERY: u64 = 4096;
/// Full blocks of each hot prompt (each prompt has one more token, in a partial block).
const HOT_BLOCKS: [usize; 6] = [1, 1, 2, 3, 4, 1];
/// Consecutive cycles of one single-block prompt in a burst: past an 11-bit stamp.
const BURST: u64 = 2300;

fn scale() -> f64 {
    std::env::var("PAGEDKV_SOAK_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0)
}

/// xorshift64*: a seeded generator (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn hot_prompts() -> Vec<Vec<u32>> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    HOT_BLOCKS
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut p = vec![1000 + i as u32];
            p.extend((0..n * B).map(|_| rng.below(50_000) as u32));
            p
        })
        .collect()
}

#[derive(Default, Debug)]
struct Figures {
    operations: u64,
    cycles: u64,
    max_cycles_one_prompt: u64,
    forks: u64,
    cow_copies: u64,
    floods: u64,
    resets: u64,
    audits: u64,
    aborts: u64,
    /// Blocks the aborts withdrew from the cache (the model's count).
    withdrawn: u64,
    truncations: u64,
}

struct Soak {
    m: BlockManager,
    hot: Vec<Vec<u32>>,
    rng: Rng,
    next_id: u64,
    /// The model of the LRU queue: hot prompts whose blocks are CACHED, least recently
    /// released first (each prompt's blocks are released together, tail first).
    lru: Vec<usize>,
    cycles_per_prompt: Vec<u64>,
    f: Figures,
}

impl Soak {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn audit(&mut self) {
        self.f.audits += 1;
        if let Err(e) = self.m.check_invariants() {
            panic!("after {} operations: {e}", self.f.operations);
        }
    }

    fn allocate(&mut self, id: u64, tokens: &[u32], lookahead: usize) -> usize {
        self.f.operations += 1;
        self.m
            .allocate(id, tokens, None, None, lookahead)
            .unwrap()
            .expect("the pool is large enough")
    }

    fn free(&mut self, id: u64) {
        self.f.operations += 1;
        self.m.free(id).unwrap();
    }

    /// Prompt `i`'s blocks were just released (the last holder freed): newest in the LRU.
    fn released(&mut self, i: usize) {
        self.lru.retain(|&p| p != i);
        self.lru.push(i);
        self.cycles_per_prompt[i] += 1;
    }

    /// One cycle of prompt `i`: a root sequence, sometimes a fork tree with appends, all
    /// freed in random order.
    fn cycle(&mut self, i: usize, tree: bool) {
        let root = self.id();
        let p = self.hot[i].clone();
        let cached = self.lru.contains(&i);
        let hit = self.allocate(root, &p, 0);
        let expect = if cached { HOT_BLOCKS[i] * B } else { 0 };
        assert_eq!(
            hit, expect,
            "prompt {i}: hits after {} ops",
            self.f.operations
        );
        let mut live = vec![root];
        if tree {
            for _ in 0..2 + self.rng.below(10) {
                let parent = live[live.len() - 1 - self.rng.below(live.len().min(3))];
                let child = self.id();
                self.f.operations += 1;
                self.m.fork(parent, child).unwrap();
                live.push(child);
                self.f.forks += 1;
            }
            for _ in 0..4 {
                let sid = live[self.rng.below(live.len())];
                // Appends never fill the tail block: nothing new is cached.
                if self.m.num_tokens(sid).unwrap() % B < B - 2 {
                    self.f.operations += 1;
                    let pairs = self.m.append(sid, &[7]).unwrap().unwrap();
                    self.f.cow_copies += pairs.len() as u64;
                }
            }
            // Roll one back to its prompt: the tail block is unhashed, so nothing is copied.
            let sid = live[self.rng.below(live.len())];
            self.f.operations += 1;
            let pairs = self.m.truncate(sid, p.len()).unwrap().unwrap();
            assert!(pairs.is_empty());
            self.f.truncations += 1;
        }
        while !live.is_empty() {
            let sid = live.swap_remove(self.rng.below(live.len()));
            self.free(sid);
        }
        self.released(i);
        self.f.cycles += 1;
    }

    /// An aborted request for prompt `i`: chunked prefill to the end, then the step never
    /// ran, so it is freed with no token computed. A cached prompt was all hits (nothing of
    /// it is withdrawn: it is released, newest in the LRU); an uncached one registered every
    /// block and withdraws them all, so it stays uncached.
    fn abort_cycle(&mut self, i: usize) {
        let root = self.id();
        let p = self.hot[i].clone();
        let cached = self.lru.contains(&i);
        let chunk = 1 + self.rng.below(p.len());
        self.f.operations += 1;
        let hit = self
            .m
            .allocate_chunk(root, &p, None, None, chunk, 0)
            .unwrap()
            .expect("the pool is large enough");
        assert_eq!(hit, if cached { HOT_BLOCKS[i] * B } else { 0 });
        let mut scheduled = self.m.num_scheduled_tokens(root).unwrap();
        while scheduled < p.len() {
            let k = (1 + self.rng.below(2 * B)).min(p.len() - scheduled);
            self.f.operations += 1;
            assert!(self.m.extend(root, k, 0).unwrap().unwrap().is_empty());
            scheduled += k;
        }
        self.f.operations += 1;
        self.m.free_computed(root, Some(0)).unwrap();
        if cached {
            self.released(i);
        } else {
            self.f.withdrawn += HOT_BLOCKS[i] as u64;
            self.cycles_per_prompt[i] += 1;
        }
        self.f.aborts += 1;
        self.f.cycles += 1;
    }

    /// Evict the `k` least recently released cached prompts and check which still hit.
    fn flood(&mut self) {
        let k = self.rng.below(self.lru.len() + 1);
        let evict: usize = self.lru[..k].iter().map(|&p| HOT_BLOCKS[p]).sum();
        let need = self.m.num_free_blocks() + evict;
        let id = self.id();
        assert_eq!(
            self.m.num_cached_blocks(),
            self.lru.iter().map(|&p| HOT_BLOCKS[p]).sum()
        );
        self.allocate(id, &[7], need * B - 1);
        self.free(id);
        let gone: Vec<usize> = self.lru.drain(..k).collect();
        self.f.floods += 1;
        // Probe every hot prompt (in random order), then release them in that order.
        let mut order: Vec<usize> = (0..self.hot.len()).collect();
        for j in (1..order.len()).rev() {
            order.swap(j, self.rng.below(j + 1));
        }
        let mut ids = Vec::new();
        for &i in &order {
            let id = self.id();
            let p = self.hot[i].clone();
            let hit = self.allocate(id, &p, 0);
            let expect = if gone.contains(&i) || !self.lru.contains(&i) {
                0
            } else {
                HOT_BLOCKS[i] * B
            };
            assert_eq!(
                hit, expect,
                "eviction order: prompt {i} hit {hit} tokens after evicting the {k} oldest \
                 prompts {gone:?} (operation {})",
                self.f.operations
            );
            ids.push((id, i));
        }
        for (id, i) in ids {
            self.free(id);
            self.released(i);
        }
    }

    fn reset(&mut self) {
        self.f.operations += 1;
        assert!(
            self.m.reset_prefix_cache().unwrap(),
            "nothing is owned between cycles"
        );
        self.lru.clear();
        self.f.resets += 1;
    }
}

fn run(cycles: u64, seed: u64) -> Figures {
    let mut c = Config::new(NUM_BLOCKS, B);
    c.hash_algo = HashAlgo::Xxh3_128;
    c.watermark = 0.0;
    let mut s = Soak {
        m: BlockManager::new(c).unwrap(),
        hot: hot_prompts(),
        rng: Rng(seed | 1),
        next_id: 0,
        lru: Vec::new(),
        cycles_per_prompt: vec![0; HOT_BLOCKS.len()],
        f: Figures::default(),
    };
    let mut done = 0;
    while done < cycles {
        let phase = s.rng.below(100);
        if phase < 2 {
            // A burst on one single-block prompt, then the eviction order and an audit.
            let i = [0, 1, 5][s.rng.below(3)];
            let withdrawals = s.rng.below(2) == 0;
            if withdrawals {
                // Uncached after the reset, the prompt's block (the free stack's top, each
                // time) is registered and withdrawn again and again.
                s.reset();
            }
            for k in 0..BURST {
                // Else every third cycle an abort of the cached prompt: all hits.
                if withdrawals || k % 3 == 2 {
                    s.abort_cycle(i);
                } else {
                    s.cycle(i, false);
                }
            }
            done += BURST;
            s.flood();
            s.audit();
        } else if phase < 3 {
            s.reset();
        } else {
            // Skewed: prompt 0 hottest.
            let r = s.rng.below(64);
            let i = (r.trailing_ones() as usize).min(HOT_BLOCKS.len() - 1);
            match s.rng.below(8) {
                0 | 1 => s.cycle(i, true),
                2 => s.abort_cycle(i),
                _ => s.cycle(i, false),
            }
            done += 1;
            if s.rng.below(200) == 0 {
                s.flood();
            }
        }
        if s.f.cycles / AUDIT_EVERY != (s.f.cycles - 1) / AUDIT_EVERY {
            s.audit();
        }
    }
    s.flood();
    s.audit();
    s.f.max_cycles_one_prompt = *s.cycles_per_prompt.iter().max().unwrap();
    let st = s.m.stats();
    assert_eq!(st.cow_copies, s.f.cow_copies);
    assert_eq!(st.unregistered_blocks, s.f.withdrawn);
    assert_eq!(st.used_blocks, 0);
    s.f
}

#[test]
fn soak_hot_blocks() {
    let cycles = (1_000_000.0 * scale()) as u64;
    let t0 = std::time::Instant::now();
    let f = run(cycles, 0x5EED);
    eprintln!(
        "[soak] rust: {} operations, {} cycles, {} on the hottest prompt, {} forks, {} \
         copy-on-write copies, {} floods, {} resets, {} audits, {} aborts withdrawing {} \
         blocks, {} truncations, {:.1} s",
        f.operations,
        f.cycles,
        f.max_cycles_one_prompt,
        f.forks,
        f.cow_copies,
        f.floods,
        f.resets,
        f.audits,
        f.aborts,
        f.withdrawn,
        f.truncations,
        t0.elapsed().as_secs_f64()
    );
    assert!(f.max_cycles_one_prompt > BURST);
    assert!(f.floods > 0 && f.audits > 1 && f.cow_copies > 0);
    assert!(f.aborts > BURST && f.withdrawn > BURST && f.truncations > 0);
}
