//! A lookahead per sequence in a step's queries: speculative decoding's verification pass
//! beside prefill chunks (docs/semantics.md, "Batch calls").
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, Error, Lookahead};

const B: usize = 4;

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// The slots of positions `from..to` through `table`.
fn slots(table: &[u32], from: usize, to: usize) -> Vec<i64> {
    (from..to)
        .map(|p| i64::from(table[p / B]) * B as i64 + (p % B) as i64)
        .collect()
}

/// Seq 1 decodes with 3 drafts crossing into block 1 (s = 4); seq 0 is a prefill chunk of
/// 6 (s = 6, room 2); seq 2 decodes with 2 drafts that fill block 1 (s = 6).
fn mixed() -> BlockManager {
    let m = BlockManager::new(Config::new(16, B)).unwrap();
    m.allocate(1, &toks(100..103), None, None, 0).unwrap();
    assert_eq!(m.append_lookahead(1, &[7], 3), Ok(Some(vec![])));
    m.allocate_chunk(0, &toks(0..10), None, None, 6, 0).unwrap();
    m.allocate(2, &toks(200..205), None, None, 0).unwrap();
    assert_eq!(m.append_lookahead(2, &[8], 2), Ok(Some(vec![])));
    m
}

#[test]
fn slot_mapping_takes_a_lookahead_per_sequence() {
    let m = mixed();
    let t = |s| m.block_table(s).unwrap();
    let las = [3, 0, 2];
    let got = m
        .slot_mapping_of(&[1, 0, 2], &[1, 6, 1], &las[..], 0)
        .unwrap();
    let want = [slots(&t(1), 3, 7), slots(&t(0), 0, 6), slots(&t(2), 5, 8)].concat();
    assert_eq!(got, want);
    // One count for all is `Lookahead::All` (a plain `usize` converts to it).
    assert_eq!(
        m.slot_mapping_of(&[1, 2], &[1, 1], 2, 0).unwrap(),
        m.slot_mapping_of(&[1, 2], &[1, 1], Lookahead::Each(&[2, 2]), 0)
            .unwrap()
    );
}

#[test]
fn flashinfer_pages_cover_each_sequences_drafts() {
    let m = mixed();
    let t = |s| m.block_table(s).unwrap();
    let (indptr, indices, last) = m
        .flashinfer_page_table_of(&[1, 0, 2], &vec![3, 0, 2], 0)
        .unwrap();
    assert_eq!(indptr, vec![0, 2, 4, 6]);
    let pages: Vec<i32> = [t(1), t(0), t(2)]
        .concat()
        .iter()
        .map(|&b| b as i32)
        .collect();
    assert_eq!(indices, pages);
    // 4 + 3 = 7 tokens: 3 in the last page; 6: 2; 6 + 2 = 8: a full last page.
    assert_eq!(last, vec![3, 2, 4]);
    // Without drafts: the scheduled tokens only (seq 1's drafts' page drops out).
    let (indptr, _, last) = m.flashinfer_page_table(&[1, 0, 2]).unwrap();
    assert_eq!((indptr, last), (vec![0, 1, 3, 5], vec![4, 2, 2]));
}

#[test]
fn a_lookahead_past_the_room_or_of_the_wrong_length_is_refused() {
    let m = mixed();
    let before = (m.stats(), m.block_table(0), m.block_table(1));
    let ids = [1, 0, 2];
    // One lookahead for the whole batch asks the prefill for slots it never reserved.
    match m.slot_mapping_of(&ids, &[1, 6, 1], 3, 0) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("sequence 0"), "{msg}"),
        other => panic!("{other:?}"),
    }
    match m.flashinfer_page_table_of(&ids, &[3, 0, 3][..], 0) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("sequence 2"), "{msg}"),
        other => panic!("{other:?}"),
    }
    for bad in [&[3, 0][..], &[3, 0, 2, 0][..], &[][..]] {
        match m.flashinfer_page_table_of(&ids, bad, 0) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("lookahead"), "{msg}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            m.slot_mapping_of(&ids, &[1, 6, 1], bad, 0),
            Err(Error::InvalidArgument(_))
        ));
    }
    // An argument error before the state: the unknown id 9 is not reached.
    assert!(matches!(
        m.flashinfer_page_table_of(&[9, 1], &[0][..], 0),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        m.flashinfer_page_table_of(&[9, 1], &[0, 0][..], 0),
        Err(Error::UnknownSequence(9))
    );
    assert_eq!((m.stats(), m.block_table(0), m.block_table(1)), before);
    m.check_invariants().unwrap();
}
