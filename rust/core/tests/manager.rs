//! The manager's operations against hand-worked expectations (docs/semantics.md).
#![cfg(not(loom))]

use pagedkv_core::{AllocStatus, BlockManager, Config, Error, KvEvent};

fn manager(num_blocks: u32, block_size: usize) -> BlockManager {
    BlockManager::new(Config::new(num_blocks, block_size)).unwrap()
}

fn with(f: impl FnOnce(&mut Config)) -> BlockManager {
    let mut c = Config::new(8, 4);
    f(&mut c);
    BlockManager::new(c).unwrap()
}

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn allocate_takes_blocks_in_order_and_counts_tokens() {
    let m = manager(8, 4);
    assert_eq!(m.allocate(1, &toks(0..6), None, None, 0), Ok(Some(0)));
    assert_eq!(m.block_table(1).unwrap(), vec![0, 1]);
    assert_eq!(m.num_tokens(1).unwrap(), 6);
    assert_eq!(m.num_free_blocks(), 6);
    m.check_invariants().unwrap();
}

#[test]
fn prefix_hits_reuse_full_blocks_and_leave_one_token_to_compute() {
    let m = manager(16, 4);
    m.allocate(1, &toks(0..8), None, None, 0).unwrap();
    // Same 8 tokens: only the first block may hit (at least one token is computed).
    assert_eq!(m.allocate(2, &toks(0..8), None, None, 0), Ok(Some(4)));
    assert_eq!(m.block_table(2).unwrap()[0], m.block_table(1).unwrap()[0]);
    assert_ne!(m.block_table(2).unwrap()[1], m.block_table(1).unwrap()[1]);
    // A longer prompt hits both blocks.
    assert_eq!(m.allocate(3, &toks(0..9), None, None, 0), Ok(Some(8)));
    let s = m.stats();
    assert_eq!((s.prefix_queries, s.prefix_hits), (25, 12));
    m.check_invariants().unwrap();
}

#[test]
fn salt_and_lora_isolate_prefixes() {
    let m = manager(16, 4);
    m.allocate(1, &toks(0..9), Some(b"a"), None, 0).unwrap();
    assert_eq!(m.allocate(2, &toks(0..9), Some(b"b"), None, 0), Ok(Some(0)));
    assert_eq!(m.allocate(3, &toks(0..9), None, Some(1), 0), Ok(Some(0)));
    assert_eq!(m.allocate(4, &toks(0..9), Some(b"a"), None, 0), Ok(Some(8)));
}

#[test]
fn lookahead_reserves_blocks_and_out_of_blocks_changes_nothing() {
    let m = manager(4, 4);
    assert_eq!(m.allocate(1, &toks(0..4), None, None, 5), Ok(Some(0)));
    assert_eq!(m.block_table(1).unwrap().len(), 3);
    let before = m.stats();
    assert_eq!(m.allocate(2, &toks(100..108), None, None, 0), Ok(None));
    assert_eq!(m.stats(), before);
    assert!(!m.contains(2));
    // Appending into the lookahead needs no new block.
    assert_eq!(m.append(1, &toks(4..9)), Ok(Some(vec![])));
    assert_eq!(m.num_free_blocks(), 1);
    m.check_invariants().unwrap();
}

#[test]
fn fork_shares_and_append_copies_on_write() {
    let m = manager(8, 4);
    m.allocate(1, &toks(0..6), None, None, 0).unwrap();
    m.fork(1, 2).unwrap();
    assert_eq!(m.table_digest(1), m.table_digest(2));
    assert_eq!(m.num_free_blocks(), 6, "fork allocates nothing");
    // Seq 2 writes into the shared partial block 1: it gets a copy.
    assert_eq!(m.append(2, &[6]), Ok(Some(vec![(1, 2)])));
    assert_eq!(m.block_table(2).unwrap(), vec![0, 2]);
    assert_ne!(m.table_digest(1), m.table_digest(2));
    // Block 1 now belongs to seq 1 alone: appending there copies nothing.
    assert_eq!(m.append(1, &[6]), Ok(Some(vec![])));
    assert_eq!(m.stats().cow_copies, 1);
    m.check_invariants().unwrap();
}

#[test]
fn free_releases_tail_first_and_eviction_takes_least_recently_released() {
    let m = with(|c| {
        c.num_blocks = 4;
        c.enable_kv_events = true;
    });
    m.allocate(1, &toks(0..9), None, None, 0).unwrap(); // blocks 0,1 full, 2 partial
    m.free(1).unwrap();
    // Block 2 (unhashed) went to the free stack; 0 and 1 are cached, tail (1) older.
    assert_eq!((m.num_free_blocks(), m.num_cached_blocks()), (2, 2));
    let stored: Vec<_> = m.drain_events().unwrap();
    assert_eq!(stored.len(), 2);
    // Needs 3 blocks: the two free ones (2 first: most recently freed), then evict block 1.
    m.allocate(2, &toks(50..61), None, None, 0).unwrap();
    assert_eq!(m.block_table(2).unwrap(), vec![2, 3, 1]);
    let removed = m.drain_events().unwrap();
    let KvEvent::BlockRemoved { block_hash, .. } = &removed[0] else {
        panic!("expected a removal first, got {removed:?}")
    };
    let KvEvent::BlockStored {
        block_hash: tail, ..
    } = &stored[1]
    else {
        panic!()
    };
    assert_eq!(
        block_hash, tail,
        "the chain's tail is evicted before its head"
    );
    assert_eq!(m.stats().evictions, 1);
    // The head block 0 still hits.
    m.free(2).unwrap();
    assert_eq!(m.allocate(3, &toks(0..5), None, None, 0), Ok(Some(4)));
    m.check_invariants().unwrap();
}

#[test]
fn a_freed_sequences_unhashed_blocks_are_reused_tail_first_as_in_vllm() {
    // vLLM frees a request's blocks tail first and puts its unhashed ones, in that order, at
    // the head of its free queue: the tail is reused first.
    let m = with(|c| {
        c.num_blocks = 6;
        c.enable_prefix_caching = false;
    });
    m.allocate(1, &toks(0..8), None, None, 0).unwrap();
    m.allocate(2, &toks(0..12), None, None, 0).unwrap();
    assert_eq!(m.block_table(2).unwrap(), vec![2, 3, 4]);
    m.free(1).unwrap();
    m.free(2).unwrap();
    // The last call's blocks first (LIFO across calls), each call's tail first.
    m.allocate(3, &toks(0..20), None, None, 0).unwrap();
    assert_eq!(m.block_table(3).unwrap(), vec![4, 3, 2, 1, 0]);
    // truncate releases its dropped entries the same way.
    m.truncate(3, 5).unwrap();
    m.allocate(4, &toks(0..12), None, None, 0).unwrap();
    assert_eq!(m.block_table(4).unwrap(), vec![0, 1, 2]);
}

#[test]
fn swap_out_and_in_report_pairs_and_keep_cached_blocks_findable() {
    let m = with(|c| c.num_cpu_blocks = 2);
    m.allocate(1, &toks(0..6), None, None, 0).unwrap();
    assert_eq!(m.swap_out(1), Ok(Some(vec![(0, 0), (1, 1)])));
    assert!(m.is_swapped(1).unwrap());
    assert_eq!(m.append(1, &[1]), Err(Error::Swapped(1)));
    assert_eq!(m.block_table(1), Err(Error::Swapped(1)));
    assert_eq!(m.num_cached_blocks(), 1, "the full block stays cached");
    assert_eq!(m.can_swap_in(1), Ok(AllocStatus::Ok));
    // The partial block 1 was freed first (tail first), then block 0 cached: the free stack
    // hands out 1 first.
    assert_eq!(m.swap_in(1), Ok(Some(vec![(0, 1), (1, 2)])));
    assert_eq!(m.num_free_cpu_blocks(), 2);
    assert_eq!(m.swap_in(1), Err(Error::NotSwapped(1)));
    let s = m.stats();
    assert_eq!((s.swapped_out_blocks, s.swapped_in_blocks), (2, 2));
    m.check_invariants().unwrap();
}

#[test]
fn swap_out_without_cpu_room_changes_nothing() {
    let m = with(|c| c.num_cpu_blocks = 1);
    m.allocate(1, &toks(0..6), None, None, 0).unwrap();
    assert_eq!(m.swap_out(1), Ok(None));
    assert!(!m.is_swapped(1).unwrap());
    assert_eq!(m.block_table(1).unwrap(), vec![0, 1]);
}

#[test]
fn can_allocate_keeps_the_watermark() {
    let m = with(|c| {
        c.num_blocks = 100;
        c.block_size = 1;
        c.watermark = 0.1;
    });
    assert_eq!(m.can_allocate(90), Ok(AllocStatus::Ok));
    assert_eq!(m.can_allocate(91), Ok(AllocStatus::Never));
    m.allocate(1, &toks(0..50), None, None, 0).unwrap();
    assert_eq!(m.can_allocate(40), Ok(AllocStatus::Ok));
    assert_eq!(m.can_allocate(41), Ok(AllocStatus::Later));
    assert!(matches!(m.can_allocate(0), Err(Error::InvalidArgument(_))));
}

#[test]
fn batch_calls_are_all_or_nothing() {
    let m = manager(4, 2);
    m.allocate(1, &[1, 2], None, None, 0).unwrap();
    m.allocate(2, &[3, 4], None, None, 0).unwrap();
    m.allocate(3, &[5], None, None, 0).unwrap();
    // 1 and 2 need a block each, only one is left.
    let before = (m.stats(), m.block_table(1), m.num_tokens(3));
    assert_eq!(m.append_batch(&[1, 2, 3], &[9, 9, 9]), Ok(None));
    assert_eq!((m.stats(), m.block_table(1), m.num_tokens(3)), before);
    assert_eq!(m.append_batch(&[3, 1], &[9, 9]), Ok(Some(vec![])));
    assert_eq!(m.block_table(1).unwrap(), vec![0, 3]);
    let (tables, width) = m.block_tables(&[1, 3], -1).unwrap();
    assert_eq!((tables, width), (vec![0, 3, 2, -1], 2));
    assert_eq!(m.slot_mapping(&[1, 3], &[2, 1]).unwrap(), vec![1, 6, 5]);
    assert_eq!(
        m.flashinfer_page_table(&[1, 3]).unwrap(),
        (vec![0, 2, 3], vec![0, 3, 2], vec![1, 2])
    );
    m.free_batch(&[1, 2]).unwrap();
    assert_eq!(m.num_sequences(), 1);
    m.check_invariants().unwrap();
}

#[test]
fn bad_input_is_refused_without_change() {
    let m = manager(8, 4);
    m.allocate(1, &[1], None, None, 0).unwrap();
    let before = m.stats();
    assert_eq!(
        m.allocate(1, &[1], None, None, 0),
        Err(Error::DuplicateSequence(1))
    );
    assert!(matches!(
        m.allocate(2, &[], None, None, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.append(9, &[1]), Err(Error::UnknownSequence(9)));
    assert_eq!(m.fork(1, 1), Err(Error::DuplicateSequence(1)));
    assert_eq!(m.fork(9, 2), Err(Error::UnknownSequence(9)));
    assert!(matches!(
        m.append_batch(&[1, 1], &[1, 1]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        m.append_batch(&[1], &[1, 1]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.free_batch(&[1, 9]), Err(Error::UnknownSequence(9)));
    assert!(matches!(
        m.slot_mapping(&[1], &[2]),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.free(9), Err(Error::UnknownSequence(9)));
    assert_eq!(m.stats(), before);
    assert!(m.contains(1));
    assert!(BlockManager::new(Config::new(0, 4)).is_err());
    assert!(BlockManager::new(Config::new(4, 0)).is_err());
}

#[test]
fn reset_refuses_while_blocks_are_owned_then_clears() {
    let m = with(|c| c.enable_kv_events = true);
    m.allocate(1, &toks(0..9), None, None, 0).unwrap();
    assert!(!m.reset_prefix_cache().unwrap());
    m.free(1).unwrap();
    m.drain_events().unwrap();
    assert!(m.reset_prefix_cache().unwrap());
    assert_eq!(m.drain_events().unwrap(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!((m.num_free_blocks(), m.num_cached_blocks()), (8, 0));
    assert_eq!(m.allocate(2, &toks(0..9), None, None, 0), Ok(Some(0)));
    // As in vLLM, whose reset only drops the hashes: the formerly cached blocks (0 and 1,
    // released tail first: 1 is the older) come after every free block, oldest first.
    assert_eq!(m.block_table(2).unwrap(), vec![2, 3, 4]);
    m.allocate(3, &toks(100..120), None, None, 0).unwrap();
    assert_eq!(m.block_table(3).unwrap(), vec![5, 6, 7, 1, 0]);
    m.check_invariants().unwrap();
}

#[test]
fn prefix_caching_off_never_hits() {
    let m = with(|c| c.enable_prefix_caching = false);
    m.allocate(1, &toks(0..9), None, None, 0).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.num_cached_blocks(), 0);
    assert_eq!(m.allocate(2, &toks(0..9), None, None, 0), Ok(Some(0)));
    assert!(m.block_hashes(2).unwrap().is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn duplicate_content_stays_unhashed_and_is_freed_not_cached() {
    let m = manager(8, 2);
    m.allocate(1, &[1, 2, 3], None, None, 0).unwrap();
    // Seq 2's prompt [1, 2] is capped below a hit; its block 0 duplicates seq 1's.
    assert_eq!(m.allocate(2, &[1, 2], None, None, 0), Ok(Some(0)));
    m.free(2).unwrap();
    assert_eq!(m.num_cached_blocks(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn absurd_slot_counts_are_refused_not_allocated() {
    let m = manager(8, 4);
    m.allocate(1, &toks(0..6), None, None, 0).unwrap();
    m.allocate(2, &toks(0..6), None, None, 0).unwrap();
    for counts in [vec![usize::MAX / 2], vec![usize::MAX, usize::MAX]] {
        let ids: Vec<u64> = (1..=counts.len() as u64).collect();
        assert!(matches!(
            m.slot_mapping(&ids, &counts),
            Err(Error::InvalidArgument(_))
        ));
    }
    m.check_invariants().unwrap();
}
