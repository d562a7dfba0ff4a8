//! The index's rules, one at a time (docs/router.md).

use pagedkv_router::{Config, EngineKey, Event, Hit, RouterError, RouterIndex};

fn stored<'a>(hashes: &[u64], parent: Option<u64>, medium: &'a str, group: u16) -> Event<'a, u64> {
    Event::Stored {
        hashes: hashes.to_vec(),
        parent,
        medium: Some(medium),
        group,
    }
}

fn removed<'a>(hashes: &[u64], medium: &'a str) -> Event<'a, u64> {
    Event::Removed {
        hashes: hashes.to_vec(),
        medium: Some(medium),
        group: 0,
    }
}

/// (engine, medium name, group, blocks), sorted.
fn answer(ix: &RouterIndex<u64>, keys: &[u64]) -> Vec<(String, String, u16, u32)> {
    let mut v: Vec<_> = ix
        .match_prefix(keys)
        .into_iter()
        .map(
            |Hit {
                 engine,
                 medium,
                 group,
                 blocks,
             }| {
                let m = ix.medium_name(medium).unwrap().unwrap_or("-").to_owned();
                (engine.to_string(), m, group, blocks)
            },
        )
        .collect();
    v.sort();
    v
}

fn e(s: &str) -> EngineKey {
    EngineKey::from(s)
}

#[test]
fn leading_blocks_per_engine_medium_and_group() {
    let ix = RouterIndex::<u64>::default();
    ix.apply(&e("a"), &[stored(&[1, 2, 3, 4], None, "GPU", 0)])
        .unwrap();
    ix.apply(
        &e("b"),
        &[
            stored(&[1, 2], None, "GPU", 0),
            stored(&[1, 2, 3], None, "CPU", 0),
        ],
    )
    .unwrap();
    ix.apply(&EngineKey::Int(7), &[stored(&[1], None, "GPU", 1)])
        .unwrap();
    assert_eq!(
        answer(&ix, &[1, 2, 3, 9]),
        vec![
            ("7".into(), "GPU".into(), 1, 1),
            ("a".into(), "GPU".into(), 0, 3),
            ("b".into(), "CPU".into(), 0, 3),
            ("b".into(), "GPU".into(), 0, 2),
        ]
    );
    // A holder that lacks the first block holds no leading block, whatever it holds after.
    assert_eq!(answer(&ix, &[9, 1, 2]), vec![]);
    assert_eq!(answer(&ix, &[]), vec![]);
    // A gap: a holds 1, 2, 4 after 3 goes; the match stops at the gap.
    ix.apply(&e("a"), &[removed(&[3], "GPU")]).unwrap();
    assert_eq!(
        answer(&ix, &[1, 2, 3, 4])[1],
        ("a".into(), "GPU".into(), 0, 2)
    );
    let s = ix.stats();
    assert_eq!((s.engines, s.holders, s.memberships), (3, 4, 3 + 2 + 3 + 1));
    ix.check_invariants().unwrap();
}

#[test]
fn orphans_duplicates_and_unknown_removals_are_counted() {
    let ix = RouterIndex::<u64>::default();
    let a = e("a");
    // The parent 100 never came: recorded all the same, counted once for the event.
    let r = ix
        .apply(&a, &[stored(&[1, 2], Some(100), "GPU", 0)])
        .unwrap();
    assert_eq!((r.stored, r.orphans), (2, 1));
    // A parent stored earlier in the same batch is known.
    let r = ix
        .apply(
            &a,
            &[
                stored(&[5], None, "GPU", 0),
                stored(&[6], Some(5), "GPU", 0),
            ],
        )
        .unwrap();
    assert_eq!(r.orphans, 0);
    // The parent is per medium: 1 is held on the GPU, not on the CPU.
    let r = ix.apply(&a, &[stored(&[3], Some(1), "CPU", 0)]).unwrap();
    assert_eq!(r.orphans, 1);
    let r = ix.apply(&a, &[stored(&[1, 2], None, "GPU", 0)]).unwrap();
    assert_eq!((r.stored, r.duplicates), (0, 2));
    let r = ix
        .apply(&a, &[removed(&[2, 42], "GPU"), removed(&[1], "DISK")])
        .unwrap();
    assert_eq!((r.removed, r.unknown_removals), (1, 2));
    let s = ix.stats();
    assert_eq!((s.orphans, s.duplicates, s.unknown_removals), (2, 2, 2));
    assert_eq!(answer(&ix, &[1, 2]), vec![("a".into(), "GPU".into(), 0, 1)]);
    ix.check_invariants().unwrap();
}

#[test]
fn cleared_and_removed_engines_go_at_once() {
    let ix = RouterIndex::<u64>::default();
    ix.apply(
        &e("a"),
        &[
            stored(&[1, 2], None, "GPU", 0),
            stored(&[1], None, "CPU", 0),
        ],
    )
    .unwrap();
    ix.apply(&e("b"), &[stored(&[1, 2], None, "GPU", 0)])
        .unwrap();
    ix.apply(&e("a"), &[Event::Cleared, stored(&[7], None, "GPU", 0)])
        .unwrap();
    assert_eq!(answer(&ix, &[1, 2]), vec![("b".into(), "GPU".into(), 0, 2)]);
    assert_eq!(answer(&ix, &[7]), vec![("a".into(), "GPU".into(), 0, 1)]);
    ix.check_invariants().unwrap();
    assert!(ix.remove_engine(&e("b")));
    assert!(!ix.remove_engine(&e("b")));
    assert_eq!(answer(&ix, &[1, 2]), vec![]);
    assert_eq!(ix.stats().memberships, 1);
    ix.check_invariants().unwrap();
    // An engine removed and seen again starts empty.
    ix.apply(&e("b"), &[stored(&[9], None, "GPU", 0)]).unwrap();
    assert_eq!(ix.blocks_of(&e("b"), Some("GPU"), 0), vec![9]);
    ix.check_invariants().unwrap();
}

#[test]
fn a_snapshot_replaces_an_engine_when_committed() {
    let ix = RouterIndex::<u64>::default();
    let a = e("a");
    ix.apply(&a, &[stored(&[1, 2, 3], None, "GPU", 0)]).unwrap();
    assert!(matches!(
        ix.apply_staged(&a, &[]),
        Err(RouterError::Snapshot(_))
    ));
    ix.begin_snapshot(&a);
    ix.apply_staged(&a, &[stored(&[1, 5], None, "GPU", 0)])
        .unwrap();
    // Not seen until committed.
    assert_eq!(answer(&ix, &[1, 5]), vec![("a".into(), "GPU".into(), 0, 1)]);
    ix.check_invariants().unwrap();
    ix.commit_snapshot(&a).unwrap();
    assert_eq!(answer(&ix, &[1, 5]), vec![("a".into(), "GPU".into(), 0, 2)]);
    assert_eq!(answer(&ix, &[1, 2]), vec![("a".into(), "GPU".into(), 0, 1)]);
    assert!(ix.commit_snapshot(&a).is_err());
    ix.begin_snapshot(&a);
    ix.apply_staged(&a, &[stored(&[8], None, "GPU", 0)])
        .unwrap();
    ix.abort_snapshot(&a);
    assert_eq!(ix.stats().memberships, 2);
    assert_eq!(ix.stats().snapshots, 1);
    ix.check_invariants().unwrap();
}

#[test]
fn too_many_holders_is_refused_and_changes_nothing() {
    let ix = RouterIndex::<u64>::new(Config {
        max_holders: 2,
        ..Config::default()
    });
    ix.apply(&e("a"), &[stored(&[1], None, "GPU", 0)]).unwrap();
    let err = ix
        .apply(
            &e("b"),
            &[
                removed(&[1], "GPU"),
                stored(&[1], None, "GPU", 0),
                stored(&[1], None, "CPU", 0),
            ],
        )
        .unwrap_err();
    assert_eq!(err, RouterError::TooManyHolders(2));
    assert_eq!(ix.stats().memberships, 1);
    assert_eq!(ix.engines(), vec![e("a")]); // the refused call left no engine "b" behind
    assert!(ix.commit_snapshot(&e("c")).is_err() && ix.apply_staged(&e("c"), &[]).is_err());
    assert_eq!(ix.stats().engines, 1);
    assert_eq!(ix.stats().rejected_payloads, 1);
    ix.check_invariants().unwrap();
    // Slots come back with their engine.
    assert!(ix.remove_engine(&e("a")));
    ix.apply(
        &e("b"),
        &[stored(&[1], None, "GPU", 0), stored(&[1], None, "CPU", 0)],
    )
    .unwrap();
    ix.check_invariants().unwrap();
}

#[test]
fn many_holders_span_words() {
    let ix = RouterIndex::<u64>::new(Config {
        max_holders: 300,
        ..Config::default()
    });
    for i in 0..200u64 {
        let chain: Vec<u64> = (0..=(i % 7)).collect();
        ix.apply(&EngineKey::Int(i), &[stored(&chain, None, "GPU", 0)])
            .unwrap();
    }
    let hits = ix.match_prefix(&[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(hits.len(), 200);
    for h in hits {
        let EngineKey::Int(i) = h.engine else {
            panic!()
        };
        assert_eq!(u64::from(h.blocks), i % 7 + 1);
    }
    ix.check_invariants().unwrap();
}

#[test]
fn digests_are_compared_whole() {
    let ix = RouterIndex::<[u8; 32]>::default();
    let mut a = [0u8; 32];
    let mut b = [0u8; 32];
    a[0] = 1;
    b[0] = 2; // same low bytes, other digest
    ix.apply(
        &e("x"),
        &[Event::Stored {
            hashes: vec![a],
            parent: None,
            medium: Some("GPU"),
            group: 0,
        }],
    )
    .unwrap();
    assert_eq!(ix.match_prefix(&[a]).len(), 1);
    assert_eq!(ix.match_prefix(&[b]).len(), 0);
    ix.check_invariants().unwrap();
}

#[test]
fn a_bad_payload_changes_nothing() {
    let ix = RouterIndex::<u64>::default();
    ix.apply(&e("a"), &[stored(&[1], None, "GPU", 0)]).unwrap();
    assert!(matches!(
        ix.apply_payload(&e("a"), b"\x93\x00garbage"),
        Err(RouterError::Payload(_))
    ));
    assert!(ix.apply_payload(&e("a"), b"").is_err());
    assert_eq!(ix.stats().rejected_payloads, 2);
    assert_eq!(ix.stats().memberships, 1);
    ix.check_invariants().unwrap();
}

#[test]
fn a_holders_log_stays_bounded_under_churn() {
    let ix = RouterIndex::<u64>::default();
    let a = e("a");
    for round in 0..20u64 {
        let chain: Vec<u64> = (round * 1000..round * 1000 + 1000).collect();
        ix.apply(&a, &[stored(&chain, None, "GPU", 0)]).unwrap();
        // Everything but the last 10 goes, and one block comes back (logged twice).
        ix.apply(
            &a,
            &[
                removed(&chain[..990], "GPU"),
                stored(&chain[..1], None, "GPU", 0),
            ],
        )
        .unwrap();
        ix.check_invariants().unwrap();
    }
    let s = ix.stats();
    assert_eq!(s.memberships, 20 * 11);
    // The log holds at most twice the blocks, its slack and one batch (in a vector at most
    // twice that), not the 20,020 stores.
    assert!(
        s.set_bytes <= 8 * 2 * (2 * 220 + 1024 + 1000),
        "{}",
        s.set_bytes
    );
    let mut held = ix.blocks_of(&a, Some("GPU"), 0);
    held.sort_unstable();
    let want: Vec<u64> = (0..20u64)
        .flat_map(|r| std::iter::once(r * 1000).chain(r * 1000 + 990..r * 1000 + 1000))
        .collect();
    assert_eq!(held, want);
}
