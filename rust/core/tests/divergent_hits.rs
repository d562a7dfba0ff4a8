//! Hits that differ per group (a full-attention group and a state group whose blocks were
//! evicted apart), each group's own hit (`lookup_blocks_per_group`) and the deeper hit a
//! load makes servable (`loaded_tokens`: the state at the loaded boundary arrives with it).
#![cfg(not(loom))]

use pagedkv_core::{AllocateOpts, BlockManager, Config, Error, GroupKind, PromptKeys, NULL};

const BS: usize = 4;

fn manager(kinds: &[GroupKind]) -> BlockManager {
    BlockManager::with_groups(Config::new(64, BS), kinds.to_vec()).unwrap()
}

/// Prefill `blocks` blocks of 0.. one block per step, so that the state group registers its
/// state at every boundary; then free it. Returns each group's table.
fn seed(m: &BlockManager, blocks: usize) -> Vec<Vec<u32>> {
    let tokens: Vec<u32> = (0..(blocks * BS) as u32).collect();
    m.allocate_chunk(1, &tokens, None, None, BS, 0)
        .unwrap()
        .unwrap();
    for _ in 1..blocks {
        m.extend(1, BS, 0).unwrap().unwrap();
    }
    let tables = (0..2).map(|g| m.block_table_of(1, g).unwrap()).collect();
    m.free(1).unwrap();
    tables
}

/// The seeded blocks of each group, whether released into the cache early (state) or not.
fn seeded_ids(m: &BlockManager, prompt: &[u32]) -> Vec<Vec<u32>> {
    m.lookup_blocks_per_group(prompt, &PromptKeys::default())
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect()
}

fn keys(cap: usize, loaded: usize) -> PromptKeys<'static> {
    PromptKeys {
        max_hit_tokens: Some(cap),
        loaded_tokens: loaded,
        ..PromptKeys::default()
    }
}

fn allocate(
    m: &BlockManager,
    id: u64,
    prompt: &[u32],
    k: usize,
    q: PromptKeys<'_>,
) -> Option<usize> {
    let opts = AllocateOpts {
        keys: q,
        num_new_tokens: Some(k),
        ..AllocateOpts::default()
    };
    m.allocate_with(id, &mut prompt.to_vec(), &opts).unwrap()
}

#[test]
fn a_load_lets_the_hit_run_as_deep_as_full_attention() {
    let m = manager(&[GroupKind::Full, GroupKind::State]);
    let fa = seed(&m, 4)[0].clone();
    let prompt: Vec<u32> = (0..24).collect(); // 4 seeded blocks + 2 new
                                              // The state group's own hit is 4 blocks: block i's state is keyed by block i.
    let all_states = seeded_ids(&m, &prompt)[1].clone();
    assert_eq!(all_states[..3], [NULL, NULL, NULL]);
    // Evict the state at boundaries 2, 3 and 4: only block 0's survives.
    let states: Vec<u32> = (1..4)
        .map(|i| {
            let (_, t) = m.lookup_blocks(&prompt, &keys((i + 1) * BS, 0)).unwrap();
            t[1][i]
        })
        .collect();
    assert_eq!(m.evict_blocks(&states), Ok(3));
    let per_group = m
        .lookup_blocks_per_group(&prompt, &PromptKeys::default())
        .unwrap();
    assert_eq!(per_group[0], (16, fa.clone()));
    assert_eq!(
        per_group[1].0, 4,
        "the state group alone reaches block 0's state"
    );
    assert_eq!(per_group[1].1.len(), 1);
    // The hit both serve right after it: one block.
    assert_eq!(
        m.lookup_blocks(&prompt, &PromptKeys::default()).unwrap().0,
        4
    );
    // With 4 tokens loaded past the hit, the state at 20 arrives with them: 16 tokens, and
    // the state group holds none of the hit.
    let (h, tables) = m.lookup_blocks(&prompt, &keys(23, 4)).unwrap();
    assert_eq!((h, tables[1].clone()), (16, vec![NULL; 4]));
    let available = m.num_available_blocks();
    assert_eq!(allocate(&m, 2, &prompt, 8, keys(16, 4)), Some(16));
    assert_eq!(m.block_table_of(2, 0).unwrap()[..4], fa[..]);
    let st = m.block_table_of(2, 1).unwrap();
    assert_eq!(st[..4], [NULL; 4]);
    assert!(st[4..].iter().all(|&b| b != NULL) && st.len() == 6);
    // 4 full-attention blocks revived, 2 new entries in each group.
    assert_eq!(m.num_available_blocks(), available - 8);
    m.check_invariants().unwrap();
    // Without a load the same cap serves only what both groups hold.
    assert_eq!(allocate(&m, 3, &prompt, 20, keys(16, 0)), Some(4));
    m.check_invariants().unwrap();
}

#[test]
fn a_deeper_state_does_not_make_a_longer_hybrid_hit() {
    let m = manager(&[GroupKind::Full, GroupKind::State]);
    let fa = seed(&m, 4)[0].clone();
    let prompt: Vec<u32> = (0..20).collect();
    // Evict the full-attention tail: the state group alone still reaches 16.
    assert_eq!(m.evict_blocks(&fa[2..]), Ok(2));
    let per_group = m
        .lookup_blocks_per_group(&prompt, &PromptKeys::default())
        .unwrap();
    assert_eq!((per_group[0].0, per_group[1].0), (8, 16));
    assert_eq!(per_group[1].1[..3], [NULL; 3]);
    // A load does not restore full attention's blocks: the hit stays at 8.
    assert_eq!(m.lookup_blocks(&prompt, &keys(19, 4)).unwrap().0, 8);
    assert_eq!(
        m.lookup_blocks(&prompt, &PromptKeys::default()).unwrap().0,
        8
    );
}

#[test]
fn a_window_needs_the_hit_blocks_it_reads_past_the_load() {
    let m = manager(&[GroupKind::Full, GroupKind::SlidingWindow { window: 8 }]);
    let tables = seed(&m, 4);
    let prompt: Vec<u32> = (0..24).collect();
    // The window group lost block 2: right after a 4-block hit it reads blocks 2 and 3.
    assert_eq!(m.evict_blocks(&[tables[1][2]]), Ok(1));
    assert_eq!(
        m.lookup_blocks(&prompt, &PromptKeys::default()).unwrap().0,
        8
    );
    // Resuming 4 tokens later (at 20) it reads from token 13 on: block 3 only.
    let (h, t) = m.lookup_blocks(&prompt, &keys(23, 4)).unwrap();
    assert_eq!(
        (h, t[1][..3].to_vec(), t[1][3]),
        (16, vec![NULL; 3], tables[1][3])
    );
}

#[test]
fn loaded_tokens_past_the_scheduled_ones_are_refused_and_change_nothing() {
    let m = manager(&[GroupKind::Full, GroupKind::State]);
    seed(&m, 2);
    let prompt: Vec<u32> = (0..12).collect();
    let before = m.num_available_blocks();
    let opts = AllocateOpts {
        keys: keys(8, 3),
        num_new_tokens: Some(2),
        ..AllocateOpts::default()
    };
    match m.allocate_with(2, &mut prompt.clone(), &opts) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("loaded_tokens 3"), "{msg}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(m.block_table_of(2, 0).is_err());
    assert_eq!(m.num_available_blocks(), before);
    assert!(matches!(
        m.lookup_blocks_per_group(&prompt, &keys(8, 1)),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        m.lookup_blocks(&prompt, &keys(8, 13)),
        Err(Error::InvalidArgument(_))
    ));
    m.check_invariants().unwrap();
}
