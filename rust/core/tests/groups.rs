//! The hybrid manager (KV-cache groups) against hand-worked expectations and its audit
//! (docs/semantics.md, "KV-cache groups").
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, Error, GroupKind, KvEvent, NULL, RC_MAX};

const FULL: GroupKind = GroupKind::Full;

fn sw(window: usize) -> GroupKind {
    GroupKind::SlidingWindow { window }
}

fn manager(num_blocks: u32, block_size: usize, kinds: &[GroupKind]) -> BlockManager {
    BlockManager::with_groups(Config::new(num_blocks, block_size), kinds.to_vec()).unwrap()
}

fn alloc(m: &BlockManager, id: u64, tokens: std::ops::Range<u32>) -> Option<usize> {
    m.allocate_from(id, &mut tokens.collect(), None, None, None, 0)
        .unwrap()
}

#[test]
fn the_null_block_is_never_handed_out() {
    let m = manager(9, 4, &[FULL, sw(16)]);
    assert_eq!(alloc(&m, 1, 0..16), Some(0));
    assert_eq!(m.block_table_of(1, 0).unwrap(), vec![1, 2, 3, 4]);
    assert_eq!(m.block_table_of(1, 1).unwrap(), vec![5, 6, 7, 8]);
    assert_eq!(alloc(&m, 2, 100..101), None, "8 usable blocks, all held");
    m.check_invariants().unwrap();
}

#[test]
fn full_attention_groups_have_no_null_block() {
    // Block 0 is the null block only when some group is not full attention.
    let m = manager(8, 4, &[FULL, FULL]);
    assert_eq!(alloc(&m, 1, 0..16), Some(0));
    assert_eq!(m.block_table_of(1, 0).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(m.block_table_of(1, 1).unwrap(), vec![4, 5, 6, 7]);
    m.check_invariants().unwrap();
    assert!(matches!(
        BlockManager::with_groups(Config::new(1, 4), vec![sw(4)]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(BlockManager::with_groups(Config::new(1, 4), vec![FULL]).is_ok());
}

#[test]
fn vllm_hybrid_prefill_hits_the_window_only() {
    // vLLM's test_prefill_hybrid_model: full + two sliding-window groups, window 32, bs 16.
    let m = manager(64, 16, &[FULL, sw(32), sw(32)]);
    assert_eq!(alloc(&m, 1, 0..55), Some(0));
    let first: Vec<Vec<u32>> = (0..3).map(|g| m.block_table_of(1, g).unwrap()).collect();
    m.free_computed(1, None).unwrap();
    // 55 tokens: 3 full blocks; a 55-token prompt with the same start hits all 3.
    assert_eq!(alloc(&m, 2, 0..55), Some(48));
    let full = m.block_table_of(2, 0).unwrap();
    assert_eq!(
        &full[..3],
        &first[0][..3],
        "full attention hits all 3 cached blocks"
    );
    for (g, cached) in first.iter().enumerate().skip(1) {
        let w = m.block_table_of(2, g).unwrap();
        assert_eq!(w[0], NULL, "the window of position 48 starts in block 1");
        assert_eq!(
            &w[1..3],
            &cached[1..3],
            "group {g} hits its window's cached blocks"
        );
    }
    m.check_invariants().unwrap();
}

#[test]
fn a_window_sequence_holds_a_bounded_number_of_blocks() {
    let m = manager(64, 4, &[FULL, sw(8)]);
    alloc(&m, 1, 0..5).unwrap();
    for t in 0..200 {
        m.append_lookahead(1, &[t], 0).unwrap().unwrap();
        let table = m.block_table_of(1, 1).unwrap();
        let held = table.iter().filter(|&&b| b != NULL).count();
        // Positions p-7..p and the block being written: at most ceil(8/4) + 1 blocks.
        assert!(held <= 3, "{held} blocks held at step {t}: {table:?}");
        assert_eq!(table.len(), m.block_table_of(1, 0).unwrap().len());
    }
    m.check_invariants().unwrap();
    let (s, g) = (m.stats(), m.group_stats());
    assert_eq!(g[1].used_blocks + g[0].used_blocks, s.used_blocks);
    assert!(g[0].used_blocks > 40 && g[1].used_blocks <= 3);
}

#[test]
fn a_hole_inside_the_window_shortens_the_hit() {
    // The window group first: `free` releases it first, so its blocks are the oldest cached.
    let m = manager(14, 4, &[sw(8), FULL]);
    let prompt: Vec<u32> = (0..21).collect();
    alloc(&m, 1, 0..21).unwrap();
    m.free_computed(1, None).unwrap();
    assert_eq!(m.lookup(&prompt, None, None).unwrap(), 20);
    // 3 free blocks, then the oldest cached one: the window group's block 4.
    assert_eq!(alloc(&m, 2, 1000..1005), Some(0));
    let (_, g) = (m.stats(), m.group_stats());
    assert_eq!(
        (g[0].evictions, g[1].evictions, g[1].cached_blocks),
        (1, 0, 5)
    );
    // Full attention still has 5 blocks; the window of 20 needs blocks 3 and 4: back to 16.
    assert_eq!(m.lookup(&prompt, None, None).unwrap(), 16);
    m.free_computed(2, None).unwrap();
    assert_eq!(alloc(&m, 3, 0..21), Some(16));
    assert_eq!(m.block_table_of(3, 0).unwrap()[..2], [NULL, NULL]);
    m.check_invariants().unwrap();
}

#[test]
fn state_groups_hit_at_block_boundaries() {
    let m = manager(32, 4, &[FULL, GroupKind::State]);
    alloc(&m, 1, 0..13).unwrap();
    let st = m.block_table_of(1, 1).unwrap();
    assert_eq!(
        st.iter().filter(|&&b| b != NULL).count(),
        4,
        "a whole first chunk"
    );
    m.append_lookahead(1, &[7], 0).unwrap().unwrap();
    let st = m.block_table_of(1, 1).unwrap();
    // Next token at 13: only the block holding the state after token 12 stays.
    assert_eq!(st[..3], [NULL, NULL, NULL]);
    m.free_computed(1, None).unwrap();
    // Blocks 0..2 of both groups are cached: the hit needs the state block 2 only.
    assert_eq!(
        m.lookup(&(0..13).collect::<Vec<_>>(), None, None).unwrap(),
        12
    );
    assert_eq!(alloc(&m, 2, 0..13), Some(12));
    let st = m.block_table_of(2, 1).unwrap();
    assert_eq!(&st[..2], &[NULL, NULL]);
    assert_ne!(st[2], NULL);
    m.check_invariants().unwrap();
}

#[test]
fn refusals_change_nothing_and_bad_groups_are_errors() {
    assert!(BlockManager::with_groups(Config::new(8, 4), vec![]).is_err());
    assert!(BlockManager::with_groups(Config::new(8, 4), vec![FULL; 65]).is_err());
    let m = manager(8, 4, &[FULL, sw(4)]);
    alloc(&m, 1, 0..4).unwrap();
    assert!(matches!(
        m.block_table_of(1, 2),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        m.block_tables_of(&[1], -1, 9),
        Err(Error::InvalidArgument(_))
    ));
    let before = (m.stats(), m.group_stats());
    // 7 usable blocks; 2 held; a 16-token prompt needs 8.
    assert_eq!(alloc(&m, 2, 50..66), None);
    assert_eq!((m.stats(), m.group_stats()), before);
    // The window moved past position 1: rolling back there is refused.
    for t in 0..8 {
        m.append_lookahead(1, &[t], 0).unwrap().unwrap();
    }
    assert!(matches!(m.truncate(1, 1), Err(Error::InvalidArgument(_))));
    m.check_invariants().unwrap();
}

#[test]
fn events_name_their_group() {
    let mut c = Config::new(16, 4);
    c.enable_kv_events = true;
    let m = BlockManager::with_groups(c, vec![FULL, sw(4)]).unwrap();
    alloc(&m, 1, 0..9).unwrap();
    let stored: Vec<u8> = m
        .drain_events()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { group, .. } => Some(*group),
            _ => None,
        })
        .collect();
    assert_eq!(
        stored,
        vec![0, 0, 1, 1],
        "one BlockStored per group per full block"
    );
}

#[test]
fn fork_refuses_at_the_refcount_limit() {
    let m = manager(4, 4, &[FULL, GroupKind::State]);
    alloc(&m, 0, 0..3).unwrap();
    for child in 1..u64::from(RC_MAX) {
        m.fork(0, child).unwrap();
    }
    let before = m.num_sequences();
    assert!(matches!(
        m.fork(0, u64::MAX),
        Err(Error::RefcountOverflow { .. })
    ));
    assert_eq!(m.num_sequences(), before);
    assert!(!m.contains(u64::MAX));
}

/// A long random mix of every operation, audited after each one.
#[test]
fn random_operations_keep_every_invariant() {
    let kinds = [
        FULL,
        sw(8),
        GroupKind::ChunkedLocal { chunk: 8 },
        GroupKind::State,
    ];
    let mut c = Config::new(48, 4);
    c.num_cpu_blocks = 24;
    c.enable_kv_events = true;
    let m = BlockManager::with_groups(c, kinds.to_vec()).unwrap();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut live: Vec<u64> = Vec::new();
    let mut id = 0u64;
    let mut done = [0usize; 10];
    for step in 0..6000 {
        let pick = live.get(next(live.len().max(1) as u64) as usize).copied();
        let op = next(10);
        match (op, pick) {
            (0 | 1, _) | (_, None) => {
                id += 1;
                let start = [0u32, 100, 200][next(3) as usize];
                let len = 1 + next(20) as u32;
                let toks: Vec<u32> = (start..start + len).collect();
                let k = Some(1 + next(u64::from(len)) as usize);
                let la = next(3) as usize;
                if m.allocate_from(id, &mut toks.clone(), None, None, k, la)
                    .unwrap()
                    .is_some()
                {
                    live.push(id);
                    done[0] += 1;
                }
            }
            (2, Some(s)) => {
                let r = m.extend(s, 1 + next(4) as usize, next(2) as usize);
                done[2] += usize::from(matches!(r, Ok(Some(_))));
            }
            (3 | 4, Some(s)) => {
                let r = m.append_lookahead(s, &[next(50) as u32], next(3) as usize);
                done[3] += usize::from(matches!(r, Ok(Some(_))));
            }
            (5, Some(s)) => {
                let n = m.num_tokens(s).unwrap();
                let r = m.truncate(s, 1 + next(n as u64) as usize);
                done[5] += usize::from(matches!(r, Ok(Some(_))));
            }
            (6, Some(s)) => {
                id += 1;
                if m.fork(s, id).is_ok() {
                    live.push(id);
                    done[6] += 1;
                }
            }
            (7, Some(s)) => {
                let c = m.num_scheduled_tokens(s).unwrap();
                let computed = (next(2) == 0).then(|| next(c as u64 + 1) as usize);
                m.free_computed(s, computed).unwrap();
                live.retain(|&x| x != s);
            }
            (8, Some(s)) => {
                let r = if m.is_swapped(s).unwrap() {
                    m.swap_in(s)
                } else {
                    m.swap_out(s)
                };
                done[8] += usize::from(matches!(r, Ok(Some(_))));
            }
            (_, Some(_)) => {
                let ready = |&s: &u64| {
                    !m.is_swapped(s).unwrap()
                        && m.num_scheduled_tokens(s).unwrap() == m.num_tokens(s).unwrap()
                };
                let batch: Vec<u64> = live.iter().copied().filter(ready).take(4).collect();
                let toks: Vec<u32> = batch.iter().map(|&b| b as u32).collect();
                let r = m.append_batch_lookahead(&batch, &toks, next(2) as usize);
                done[9] += usize::from(matches!(r, Ok(Some(_))));
            }
        }
        m.check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
    // Every kind of call succeeded often enough to matter, and the cache served hits.
    assert!(
        done.iter()
            .enumerate()
            .all(|(i, &d)| [1, 4, 7].contains(&i) || d > 20),
        "{done:?}"
    );
    let (s, g) = (m.stats(), m.group_stats());
    assert!(
        s.prefix_hits > 0 && g.iter().all(|g| g.evictions > 0),
        "{s:?} {g:?}"
    );
    m.free_batch(&live).unwrap();
    m.check_invariants().unwrap();
    assert!(m.reset_prefix_cache().unwrap());
    let (s, _) = (m.stats(), m.group_stats());
    assert_eq!(s.free_blocks, 47);
    assert_eq!(s.free_cpu_blocks, 24);
}
