//! The tenant registry's removal (`tenants/registry.rs`): a tenant leaves exactly when its
//! last ref and its last CACHED block are gone, whichever goes last, and never while a call
//! holds a ref on it (so a tenant id is never given to another salt while named).

use super::{model, Seen};
use crate::tenants::registry::Registry;
use loom::sync::Arc;
use loom::thread;

const SALT: &[u8] = b"t";

/// A tenant with one ref (its sequence) and one CACHED block.
fn one_ref_one_block() -> (Arc<Registry>, u32) {
    let r = Arc::new(Registry::default());
    let id = r.acquire(Some(SALT));
    r.cached(id, true);
    (r, id)
}

/// The sequence is freed while another call evicts the block: whichever order, the tenant
/// leaves once, and its id is the first one given out again.
#[test]
fn the_last_of_refs_and_cached_blocks_removes_the_tenant_once() {
    model(None, || {
        let (r, id) = one_ref_one_block();
        let freer = {
            let r = r.clone();
            thread::spawn(move || r.release(id))
        };
        r.cached(id, false);
        freer.join().unwrap();
        assert_eq!(r.find(Some(SALT)), None, "it had nothing left");
        assert_eq!(r.len(), 1);
        assert_eq!(r.acquire(Some(b"u")), id, "its id is free, once");
        assert_ne!(r.acquire(Some(b"v")), id);
    });
}

/// A new call of the tenant takes a ref while its sequence is freed and its block evicted:
/// the call's tenant is present at the end, whether it came before the removal (same record)
/// or after (a new one), and holds exactly its ref.
#[test]
fn a_tenant_with_a_ref_in_flight_is_never_removed() {
    const SAME: u32 = 0;
    const AFRESH: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let (r, id) = one_ref_one_block();
        let caller = {
            let r = r.clone();
            thread::spawn(move || r.acquire(Some(SALT)))
        };
        let evicter = {
            let r = r.clone();
            thread::spawn(move || r.cached(id, false))
        };
        r.release(id);
        let got = caller.join().unwrap();
        evicter.join().unwrap();
        assert_eq!(r.find(Some(SALT)), Some(got), "present while its call runs");
        assert_eq!(r.refs(got), 1);
        assert_eq!(r.counts(got).cached, 0);
        assert_eq!(r.len(), 2);
        // The same id either way (lowest free): whether it stayed is in its counters.
        s.saw(if r.rows().iter().any(|w| w.id == got && w.order == 1) {
            SAME
        } else {
            AFRESH
        });
    });
    seen.assert_saw(&[SAME, AFRESH]);
}
