//! The free stack (`free_stack.rs`): pops and pushes, chain pushes, and an allocation racing a
//! free on its head never lose or duplicate an id.

use super::pool_with_owned_block;
use crate::free_stack::FreeStack;
use loom::sync::Arc;
use loom::thread;

#[test]
fn free_stack_pop_push_never_loses_or_duplicates() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2).unwrap());
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    if let Some(b) = s.pop() {
                        s.push(b);
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let mut ids = s.snapshot(4);
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1]);
    });
}

#[test]
fn free_stack_chain_push_races_pops_without_loss() {
    // One thread pops two ids and gives both back with one chain push while another pops
    // and pushes one: no id is lost or duplicated, and the chain stays linked.
    loom::model(|| {
        let s = Arc::new(FreeStack::full(3).unwrap());
        let chain = {
            let s = s.clone();
            thread::spawn(move || {
                let held: Vec<u32> = [s.pop(), s.pop()].into_iter().flatten().collect();
                s.push_all(&held);
            })
        };
        if let Some(b) = s.pop() {
            s.push(b);
        }
        chain.join().unwrap();
        let mut ids = s.snapshot(8);
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(s.len(), 3);
    });
}

#[test]
fn free_stack_concurrent_pops_get_distinct_ids() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2).unwrap());
        let a = {
            let s = s.clone();
            thread::spawn(move || s.pop())
        };
        let b = s.pop();
        let a = a.join().unwrap();
        assert_ne!(a, b);
        assert!(a.is_some() && b.is_some());
        assert_eq!(s.pop(), None);
    });
}

/// Allocate vs free on the free stack's head: one thread releases an unhashed block (push)
/// while another allocates (pop). The allocator gets one of the two blocks, the other is on
/// the free stack, and the counts balance.
#[test]
fn allocation_and_free_race_on_the_free_stack_head() {
    loom::model(|| {
        let pool = pool_with_owned_block(2, 1, None);
        let freer = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, None).unwrap())
        };
        assert!(pool.reserve(1), "block 1 is free from the start");
        let got = pool.take();
        freer.join().unwrap();
        let mut refs = vec![0; 2];
        refs[got as usize] = 1;
        pool.audit(&refs).unwrap();
        assert_eq!((pool.num_free(), pool.num_available()), (1, 1));
    });
}
