//! `Policy::peek` and `cross_rank` for every policy: on fixed-seed random call sequences the
//! peek before each victim is that victim, a second peek is the first, and peeks taken
//! between other calls leave a valid policy, whose victims (but S3-FIFO's, whose peek makes
//! its moves for real) are exactly those of a run without them. The priority policy's peek
//! and the clock; S3-FIFO's hand-worked peeks are in `s3fifo.rs`.

use super::test_util::{entry, k, Rng};
use super::{
    new_policy, CrossRank, EvictionKind, Lru, Policy, Retention, DEFAULT_PRIORITY, NO_CROSS_RANK,
};
use crate::clock::Clock;
use crate::eviction_order::plain::PlainLru;
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use std::collections::BTreeMap;
use std::sync::Arc;

const NUM_BLOCKS: u32 = 12;

/// A policy with its own manual clock (only the priority policy reads it).
type Made = (&'static str, Box<dyn Policy>, Arc<Clock>);

/// Every policy with a peek: the five kinds, the locked LRU and the locked-mode tests'
/// plain LRU.
fn all() -> Vec<Made> {
    let n = NUM_BLOCKS as usize;
    let mut out: Vec<Made> = EvictionKind::ALL
        .into_iter()
        .skip(1) // the lock-free LRU has no policy object
        .map(|kind| {
            let clock = manual_clock();
            let p = new_policy(kind, n, &clock).unwrap().unwrap();
            (kind.name(), p, clock)
        })
        .collect();
    out.push(("lru", Box::new(Lru::new(n).unwrap()), manual_clock()));
    out.push(("plain", Box::<PlainLru>::default(), manual_clock()));
    out
}

/// Whether `name`'s peek changes nothing a victim could see.
fn pure(name: &str) -> bool {
    name != "s3fifo"
}

/// Often the block's own content coming back, sometimes content shared by blocks.
fn key_for(rng: &mut Rng, block: u32) -> String {
    if rng.below(4) == 0 {
        format!("shared{}", rng.below(6))
    } else {
        format!("key{}-{block}", rng.below(3))
    }
}

fn retention(rng: &mut Rng) -> Retention {
    let priority = [0, 20, 35, 35, 50, 100][rng.below(6) as usize];
    let duration = [None, None, Some(0.0), Some(0.5), Some(2.0)][rng.below(5) as usize];
    Retention { priority, duration }
}

/// When a run peeks.
#[derive(Clone, Copy, PartialEq)]
enum Peeks {
    Never,
    /// Right before each victim (and twice).
    BeforeVictims,
    /// At random between any calls, and before some victims.
    Anywhere,
}

/// An entry's fields, to compare.
fn rec(e: Option<Entry>) -> Option<(u32, u64, Digest)> {
    e.map(|e| (e.block, e.generation, e.digest))
}

fn sorted(entries: Vec<Entry>) -> Vec<u32> {
    let mut v: Vec<u32> = entries.iter().map(|e| e.block).collect();
    v.sort_unstable();
    v
}

/// One peek, checked: it names a member with its record, a second peek names the same,
/// neither changes the set.
fn peek(p: &mut dyn Policy, inside: &BTreeMap<u32, Entry>, at: &str) -> Option<Entry> {
    let members = sorted(p.entries());
    let got = p.peek();
    assert_eq!(rec(p.peek()), rec(got), "{at}: a second peek differs");
    assert_eq!(p.len(), inside.len(), "{at}: a peek changed the set");
    assert_eq!(sorted(p.entries()), members, "{at}: a peek changed the set");
    match got {
        None => assert!(inside.is_empty(), "{at}: no peek from a non-empty set"),
        Some(e) => assert_eq!(rec(inside.get(&e.block).copied()), rec(got), "{at}: peek"),
    }
    got
}

/// Random calls to `p` (the same calls for the same seed while the victims agree), checking
/// the contract: victims are members with their records, each cached block leaves once, a
/// peek right before a victim is that victim. Returns the victims.
fn run(name: &str, p: &mut dyn Policy, clock: &Clock, seed: u64, peeks: Peeks) -> Vec<u32> {
    let mut rng = Rng(seed);
    let mut peek_rng = Rng(seed ^ 0x7e57_0f9e);
    let mut now = 0.0;
    let mut inside: BTreeMap<u32, Entry> = BTreeMap::new();
    let mut hit_last: Option<Entry> = None; // restorable: hit by the latest call
    let mut victims = Vec::new();
    let mut peeked_then_called = 0;
    let mut peeked = false;
    for step in 0..12_000u64 {
        let at = format!("{name} step {step}");
        now += [0.0, 0.0, 0.25, 0.5, 1.0][rng.below(5) as usize];
        clock.set(now).unwrap();
        if peeks == Peeks::Anywhere && peek_rng.below(3) == 0 {
            peek(p, &inside, &at);
            peeked = true;
        }
        let b = rng.below(u64::from(NUM_BLOCKS)) as u32;
        let op = rng.below(100);
        let was_hit = hit_last.take();
        if (60..97).contains(&op) {
            // A victim (a peek right before it must name it).
            let want = match peeks {
                Peeks::Never => None,
                Peeks::BeforeVictims => Some(peek(p, &inside, &at)),
                Peeks::Anywhere => (peek_rng.below(2) == 0).then(|| peek(p, &inside, &at)),
            };
            let got = p.victim();
            if let Some(want) = want {
                assert_eq!(rec(got), rec(want), "{at}: the victim is not the peek");
            }
            match got {
                None => assert!(inside.is_empty(), "{at}: no victim"),
                Some(v) => {
                    assert_eq!(rec(inside.remove(&v.block)), rec(got), "{at}: victim");
                    victims.push(v.block);
                }
            }
        } else {
            peeked_then_called += usize::from(peeked);
            if let (Some(e), true) = (was_hit, op < 15) {
                let e = Entry {
                    generation: e.generation + 1,
                    ..e
                };
                p.restore(e);
                inside.insert(e.block, e);
            } else if op < 30 && !inside.contains_key(&b) {
                let e = Entry {
                    block: b,
                    generation: step,
                    digest: k(&key_for(&mut rng, b)),
                };
                p.cached(e);
                inside.insert(b, e);
            } else if op < 42 && inside.contains_key(&b) {
                p.hit(b);
                hit_last = inside.remove(&b);
            } else if op < 46 && inside.contains_key(&b) {
                p.removed(b);
                inside.remove(&b);
            } else if op < 52 {
                p.miss(&k(&key_for(&mut rng, b)));
            } else if op < 59 && hit_last.is_none() {
                // The manager gives retention to a block it holds; here to any, as the
                // priority policy allows (the others never see the call).
                p.set_retention(b, retention(&mut rng));
            } else if op == 59 {
                assert_eq!(
                    sorted(p.clear()),
                    sorted(inside.values().copied().collect())
                );
                inside.clear();
            } else {
                // Every step calls the policy after its peek: the priority policy's victim
                // right after a peek is the peek's even when the clock moved on since,
                // which a run without the peek would not see.
                p.miss(&k("never cached"));
            }
        }
        peeked = false;
        assert_eq!(p.len(), inside.len(), "{at}");
    }
    while let Some(v) = p.victim() {
        assert_eq!(
            rec(inside.remove(&v.block)),
            rec(Some(v)),
            "{name}: drained"
        );
        victims.push(v.block);
    }
    assert!(inside.is_empty(), "{name}: {inside:?} never left");
    assert!(
        victims.len() > 2_000,
        "{name}: only {} victims",
        victims.len()
    );
    if peeks == Peeks::Anywhere {
        assert!(peeked_then_called > 1_000, "{name}: few calls after a peek");
    }
    victims
}

fn manual_clock() -> Arc<Clock> {
    let clock = Arc::new(Clock::default());
    clock.set(0.0).unwrap();
    clock
}

#[test]
fn the_peek_before_each_victim_is_that_victim() {
    for (name, mut p, clock) in all() {
        run(
            name,
            p.as_mut(),
            &clock,
            0x9eec_1234_5678_9abd,
            Peeks::BeforeVictims,
        );
    }
}

#[test]
fn peeks_between_other_calls_leave_a_valid_policy_and_pure_ones_no_trace() {
    for seed in [0x0123_4567_89ab_cdef, 0x5eed_5eed_0000_0001] {
        for ((name, mut a, ca), (_, mut b, cb)) in all().into_iter().zip(all()) {
            let without = run(name, a.as_mut(), &ca, seed, Peeks::Never);
            let with = run(name, b.as_mut(), &cb, seed, Peeks::Anywhere);
            if pure(name) {
                assert_eq!(with, without, "{name}: peeks changed the victims");
            }
        }
    }
}

#[test]
fn priority_victim_after_a_peek_is_the_peek_while_the_clock_runs_on() {
    let clock = manual_clock();
    let mut p = new_policy(EvictionKind::Priority, 4, &clock)
        .unwrap()
        .unwrap();
    let low = Retention {
        priority: 10,
        duration: Some(1.0),
    };
    p.set_retention(0, low);
    p.cached(entry(0, "a")); // priority 10 until t = 1, released at 0
    p.cached(entry(1, "b")); // default, released at 0
    assert_eq!(p.cross_rank(0), (10, 0.0, 1));
    assert_eq!(p.cross_rank(1), (DEFAULT_PRIORITY, 0.0, 1));
    assert_eq!(p.peek().map(|e| e.block), Some(0));
    clock.set(1.0).unwrap(); // 0 runs out: at t = 1 the order is 1 (released at 0), 0 (at 1)
                             // No call came between: the rank and the victim are the peek's, at t = 0.
    assert_eq!(p.cross_rank(0), (10, 0.0, 1));
    assert_eq!(p.victim().map(|e| e.block), Some(0));

    // A call between (here a miss) and the victim is decided at its own time.
    p.set_retention(2, low);
    p.cached(entry(2, "c")); // priority 10 until t = 2, released at 1
    assert_eq!(p.peek().map(|e| e.block), Some(2));
    clock.set(2.0).unwrap();
    assert_eq!(p.cross_rank(2), (10, 1.0, 1));
    p.miss(&k("x"));
    assert_eq!(p.cross_rank(2), (DEFAULT_PRIORITY, 2.0, 0));
    assert_eq!(p.peek().map(|e| e.block), Some(1));
    assert_eq!(p.victim().map(|e| e.block), Some(1));
    assert_eq!(p.cross_rank(2), (DEFAULT_PRIORITY, 2.0, 0));
    assert_eq!(p.victim().map(|e| e.block), Some(2));
    assert!(p.peek().is_none());
}

#[test]
fn cross_rank_is_constant_but_for_priority() {
    for (name, mut p, _) in all() {
        p.cached(entry(3, "k3"));
        let want: CrossRank = if name == "priority" {
            (DEFAULT_PRIORITY, 0.0, 1)
        } else {
            NO_CROSS_RANK
        };
        assert_eq!(p.cross_rank(3), want, "{name}");
    }
}
