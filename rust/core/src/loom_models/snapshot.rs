//! A KV event snapshot (`kv_event_snapshot`) racing an eviction and a registration of one
//! digest: the snapshot is taken between two events, so the snapshot followed by the events
//! drained after it describes exactly the final index, whichever of the three came first.

use super::{digest, model, pool_all_owned, replay_one_digest, stored, Seen};
use loom::thread;

/// Block 0 is cached under `d`; one thread evicts it (a take that finds the free stack
/// empty), another registers `d` on block 1, and the main thread takes a snapshot. A router
/// that applies the snapshot and then every later event must end with `d` exactly when the
/// index holds it, and never see an event that does not change what it holds (a removal of
/// a block it lacks, a store of one it has). The snapshot must be seen both with and
/// without `d`.
#[test]
fn snapshot_between_an_eviction_and_a_registration() {
    const SNAPSHOT_HELD_D: u32 = 0;
    const SNAPSHOT_LACKED_D: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let d = digest(1);
        let pool = pool_all_owned(2, true);
        assert!(pool.register(0, d, None, || stored(d)));
        pool.release(0, Some(&d)).unwrap();
        let evictor = {
            let pool = pool.clone();
            thread::spawn(move || {
                assert!(pool.reserve(1));
                assert_eq!(pool.take(), 0, "the free stack is empty: evicts block 0");
            })
        };
        let registrar = {
            let pool = pool.clone();
            thread::spawn(move || pool.register(1, d, None, || stored(d)))
        };
        let snapshot = pool.event_log().unwrap().snapshot().to_vec();
        evictor.join().unwrap();
        registrar.join().unwrap();
        let held = match snapshot.as_slice() {
            [] => false,
            [e] if *e == stored(d) => true,
            other => panic!("a snapshot of at most d, got {other:?}"),
        };
        s.saw(if held {
            SNAPSHOT_HELD_D
        } else {
            SNAPSHOT_LACKED_D
        });
        let held = replay_one_digest(pool.drain_events().unwrap(), d, held);
        assert_eq!(held, pool.peek(&d).is_some());
        let again = pool.event_log().unwrap().snapshot().to_vec();
        assert_eq!(
            again.len(),
            usize::from(held),
            "the described set is the index"
        );
        pool.audit(&[1, 1]).unwrap();
    });
    seen.assert_saw(&[SNAPSHOT_HELD_D, SNAPSHOT_LACKED_D]);
}
