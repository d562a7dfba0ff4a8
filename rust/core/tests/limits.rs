//! The refcount limit: a block has at most 2**20 - 1 holders. A `fork` or a prefix-hit
//! `allocate` that would exceed it fails with `Error::RefcountOverflow` and changes nothing.
//!
//! This file needs `Error::RefcountOverflow` (added with the fix): until then it does not
//! compile, which is why it is kept apart from the other tests.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, Error};

const MAX_HOLDERS: u64 = (1 << 20) - 1;

#[test]
fn refcount_overflow_is_an_error_that_changes_nothing() {
    let m = BlockManager::new(Config::new(64, 4)).unwrap();
    let prompt: Vec<u32> = (0..9).collect(); // two full blocks and one partial
    assert_eq!(m.allocate(0, &prompt, None, None, 0), Ok(Some(0)));
    // Fork until every block of sequence 0 has the maximum number of holders.
    for child in 1..MAX_HOLDERS {
        m.fork(0, child).unwrap();
    }
    assert_eq!(m.num_sequences() as u64, MAX_HOLDERS);
    m.check_invariants().unwrap();
    let before = m.stats();
    let table = m.block_table(0).unwrap();

    // One more holder by fork.
    assert_eq!(
        m.fork(0, MAX_HOLDERS),
        Err(Error::RefcountOverflow {
            block: 0,
            limit: pagedkv_core::RC_MAX
        })
    );
    assert!(!m.contains(MAX_HOLDERS));
    assert_eq!(m.stats(), before);
    assert_eq!(m.block_table(0).unwrap(), table);
    m.check_invariants().unwrap();

    // One more holder by a prefix hit on the first block.
    let id = MAX_HOLDERS + 1;
    assert_eq!(
        m.allocate(id, &prompt[..5], None, None, 0),
        Err(Error::RefcountOverflow {
            block: 0,
            limit: pagedkv_core::RC_MAX
        })
    );
    assert!(!m.contains(id));
    assert_eq!(m.stats(), before);
    m.check_invariants().unwrap();

    // Below the limit again, both work.
    m.free(1).unwrap();
    assert_eq!(m.allocate(id, &prompt[..5], None, None, 0), Ok(Some(4)));
    assert_eq!(
        m.fork(0, MAX_HOLDERS),
        Err(Error::RefcountOverflow {
            block: 0,
            limit: pagedkv_core::RC_MAX
        })
    );
    m.free(id).unwrap();
    m.fork(0, MAX_HOLDERS).unwrap();
    m.check_invariants().unwrap();
}
