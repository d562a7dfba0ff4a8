//! The broken-manager guard and the non-blocking mode, driven from inside the crate (the
//! corruption and the held locks need private access).

use crate::sync::lock;
use crate::{nonblocking, BlockManager, Config, Error};

fn manager() -> BlockManager {
    let m = BlockManager::new(Config::new(8, 2)).unwrap();
    m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
    m.allocate(2, &[4, 5], None, None, 0).unwrap().unwrap();
    m
}

#[test]
fn a_failed_invariant_breaks_the_manager_and_refuses_later_changes() {
    let m = manager();
    // Corrupt sequence 1's table so that freeing it releases a FREE block.
    lock(&m.seqs.get(1).unwrap().seq).blocks[0] = 7;
    let err = m.free(1).unwrap_err();
    assert!(
        matches!(err, Error::Broken(ref why) if why.contains("block 7")),
        "{err:?}"
    );
    assert!(m.is_broken());
    // Every mutating call is refused before it does anything; reads still answer.
    let before = m.stats();
    assert!(matches!(
        m.allocate(3, &[9], None, None, 0),
        Err(Error::Broken(_))
    ));
    assert!(matches!(m.append(2, &[6]), Err(Error::Broken(_))));
    assert!(matches!(m.free(2), Err(Error::Broken(_))));
    assert!(matches!(m.reset_prefix_cache(), Err(Error::Broken(_))));
    assert_eq!(m.stats(), before);
    assert_eq!(m.num_tokens(2), Ok(2));
}

#[test]
fn a_panic_inside_a_call_becomes_a_broken_error_not_an_unwind() {
    let m = manager();
    let out: crate::Result<()> = m.guarded(true, || panic!("boom at step {}", 3));
    assert!(matches!(out, Err(Error::Broken(ref why)) if why.contains("boom at step 3")));
    assert!(matches!(m.fork(2, 5), Err(Error::Broken(ref why)) if why.contains("boom")));
}

#[test]
fn nonblocking_calls_back_out_of_a_busy_sequence_and_change_nothing() {
    let m = manager();
    let cell = m.seqs.get(2).unwrap();
    let held = lock(&cell.seq);
    let before = m.stats();
    assert_eq!(nonblocking(|| m.append(2, &[6])), Err(Error::WouldBlock));
    assert_eq!(nonblocking(|| m.free(2)), Err(Error::WouldBlock));
    assert_eq!(nonblocking(|| m.fork(2, 9)), Err(Error::WouldBlock));
    assert_eq!(
        nonblocking(|| m.block_tables(&[1, 2], -1)),
        Err(Error::WouldBlock)
    );
    assert_eq!(
        nonblocking(|| m.free_batch(&[1, 2])),
        Err(Error::WouldBlock)
    );
    // Creating the id of a sequence being freed waits for the free: here it backs out.
    assert_eq!(m.stats(), before);
    assert!(m.contains(1) && m.contains(2) && !m.contains(9));
    // Calls that need no busy lock go through in non-blocking mode.
    assert_eq!(nonblocking(|| m.num_tokens(1)), Ok(3));
    drop(held);
    assert_eq!(nonblocking(|| m.append(2, &[6])), Ok(Some(vec![])));
    m.check_invariants().unwrap();
}

#[test]
fn nonblocking_calls_back_out_while_a_reset_holds_the_gate() {
    let m = manager();
    m.free_batch(&[1, 2]).unwrap();
    let waited = m
        .gate
        .exclusive(|| nonblocking(|| m.allocate(4, &[1, 2, 3], None, None, 0)));
    assert_eq!(waited, Err(Error::WouldBlock));
    assert!(!m.contains(4));
    assert_eq!(m.allocate(4, &[1, 2, 3], None, None, 0), Ok(Some(2)));
}

#[test]
fn a_racing_creator_of_the_same_id_waits_for_the_pending_one() {
    // A pending cell is settled under its lock: a second creator sees Duplicate only if the
    // first succeeded, and creates the id itself if the first returned None.
    let m = std::sync::Arc::new(BlockManager::new(Config::new(4, 2)).unwrap());
    for round in 0..200u64 {
        let id = 100 + round;
        let big: Vec<u32> = (0..10).collect(); // 5 blocks: never fits in 4
        let small = [1u32, 2];
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.allocate(id, &big, None, None, 0));
        let b = m.allocate(id, &small, None, None, 0);
        let a = t.join().unwrap();
        // Serially: big then small (None, Some), or small then big (Duplicate, Some). The
        // small one never sees the failed big one's pending id as a duplicate.
        assert!(
            matches!(a, Ok(None) | Err(Error::DuplicateSequence(_))),
            "{a:?}"
        );
        assert_eq!(b, Ok(Some(0)), "the small prompt always creates the id");
        m.free(id).unwrap();
    }
    m.check_invariants().unwrap();
}
