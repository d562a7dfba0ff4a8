//! The reference's hand-worked retention cases (`tests/core/test_eviction_reference.py`,
//! those without pins: the pool handles pins), expiry to the exact tick, `restore`, and
//! random sequences against a plain model of the reference (`priority.py`'s ranks computed
//! from scratch at every victim).

use super::*;
use crate::eviction::test_util::{entry, k, Rng};
use std::collections::HashMap;

fn ret(priority: u8, duration: Option<f64>) -> Retention {
    Retention { priority, duration }
}

/// A policy on a manual clock.
struct Fixture {
    clock: Arc<Clock>,
    p: PriorityPolicy,
}

impl Fixture {
    fn new(num_blocks: usize) -> Self {
        let clock = Arc::new(Clock::default());
        clock.set(0.0).unwrap();
        let p = PriorityPolicy::new(num_blocks, &clock).unwrap();
        Self { clock, p }
    }

    /// The policy, with the clock at `t`.
    fn at(&mut self, t: f64) -> &mut PriorityPolicy {
        self.clock.set(t).unwrap();
        &mut self.p
    }

    fn cache(&mut self, block: u32, t: f64) {
        self.at(t).cached(entry(block, &format!("k{block}")));
    }

    fn victim(&mut self, t: f64) -> Option<u32> {
        self.at(t).victim().map(|e| e.block)
    }

    fn order(&mut self, t: f64) -> Vec<u32> {
        self.at(t).inner.rules.order()
    }

    fn priority_of(&mut self, block: u32, t: f64) -> u8 {
        self.at(t).inner.rules.priority_of(block)
    }

    fn retention(&self, block: u32) -> Retention {
        self.p.inner.rules.slots[block as usize].retention
    }
}

/// The float just below `t` (> 0): one tick of the clock before it.
fn before(t: f64) -> f64 {
    f64::from_bits(t.to_bits() - 1)
}

#[test]
fn hand_worked() {
    let mut f = Fixture::new(8);
    f.p.set_retention(0, ret(80, Some(10.0))); // set while held: applies from its release
    f.cache(0, 0.0); // priority 80 until t = 0 + 10
    f.p.set_retention(1, ret(20, None));
    f.cache(1, 1.0);
    f.cache(2, 2.0); // default 35
    assert_eq!(f.order(4.0), vec![1, 2, 0]); // 20 < 35 < 80
    assert_eq!(f.victim(4.0), Some(1));
    assert_eq!(f.victim(5.0), Some(2));
    f.cache(4, 6.0);
    assert_eq!(f.victim(9.0), Some(4)); // 0 is still at 80 until t = 10
    f.cache(5, 9.5);
    f.cache(6, 10.0);
    // At t = 12, 0 is at the default priority, as if released at its deadline 10: after 5
    // (released at 9.5), before 6 (released at the deadline itself).
    assert_eq!(f.order(12.0), vec![5, 0, 6]);
    let drained: Vec<u32> = std::iter::from_fn(|| f.victim(12.0)).collect();
    assert_eq!(drained, vec![5, 0, 6]);
    assert_eq!(f.p.len(), 0);
    // Evicted, a block forgets its retention.
    assert_eq!(f.retention(0), DEFAULT);
    assert_eq!(f.retention(1), DEFAULT);
}

#[test]
fn expiry_is_exact_on_the_clock() {
    let mut f = Fixture::new(16);
    f.p.set_retention(7, ret(90, Some(0.5)));
    f.cache(7, 100.0); // at 90 until 100.5
    f.p.set_retention(11, ret(40, None));
    f.cache(11, 100.1);
    f.cache(8, 100.25);
    f.cache(9, 100.4);
    // One tick before the deadline 7 is still at 90, behind everything.
    assert_eq!(f.priority_of(7, before(100.5)), 90);
    assert_eq!(f.order(before(100.5)), vec![8, 9, 11, 7]);
    // At the deadline it is a default block released at 100.5: after 9 (100.4), ahead of
    // 10, released at the same instant, and of 11 (priority 40).
    assert_eq!(f.priority_of(7, 100.5), DEFAULT_PRIORITY);
    f.cache(10, 100.5);
    assert_eq!(f.order(100.5), vec![8, 9, 7, 10, 11]);
    // Asking late changes nothing: the order is a function of the times alone.
    assert_eq!(f.order(1e6), vec![8, 9, 7, 10, 11]);
    let drained: Vec<u32> = std::iter::from_fn(|| f.victim(1e6)).collect();
    assert_eq!(drained, vec![8, 9, 7, 10, 11]);
}

#[test]
fn a_block_is_protected_until_the_tick_of_its_deadline() {
    for (t, want) in [(before(3.0), 1), (3.0, 0)] {
        let mut f = Fixture::new(2);
        f.p.set_retention(0, ret(90, Some(2.0)));
        f.cache(0, 1.0); // 90 until 3.0
        f.p.set_retention(1, ret(40, None));
        f.cache(1, 1.5);
        assert_eq!(f.victim(t), Some(want), "at {t}");
    }
}

#[test]
fn expired_blocks_keep_their_deadline_order() {
    // Two blocks whose deadlines pass before any victim: each is placed at its own
    // deadline, whatever their priorities and release order.
    let mut f = Fixture::new(4);
    f.p.set_retention(0, ret(10, Some(5.0))); // 10 until 5.0 (lower priority expires too)
    f.cache(0, 0.0);
    f.p.set_retention(1, ret(90, Some(1.0))); // 90 until 2.0
    f.cache(1, 1.0);
    f.cache(2, 3.0);
    f.p.set_retention(3, ret(0, Some(0.0))); // expired at its release 4.0
    f.cache(3, 4.0);
    assert_eq!(f.order(4.5), vec![0, 1, 2, 3]); // 0 is at 10 until 5.0
    assert_eq!(f.order(6.0), vec![1, 2, 3, 0]);
}

#[test]
fn retention_survives_a_hit_with_a_fresh_duration_until_it_runs_out() {
    let mut f = Fixture::new(2);
    f.p.set_retention(0, ret(60, Some(10.0)));
    f.cache(0, 0.0);
    f.at(5.0).hit(0); // revived before the deadline 10: keeps 60, fresh 10 s at release
    f.cache(0, 8.0);
    assert_eq!(f.priority_of(0, 17.9), 60); // deadline 18
    assert_eq!(f.priority_of(0, before(18.0)), 60);
    assert_eq!(f.priority_of(0, 18.0), DEFAULT_PRIORITY);
    f.at(20.0).hit(0); // revived after it ran out: default for good
    assert_eq!(f.retention(0), DEFAULT);
    f.cache(0, 21.0);
    assert_eq!(f.priority_of(0, 21.0), DEFAULT_PRIORITY);
}

#[test]
fn a_reviving_request_overrides_the_retention() {
    let mut f = Fixture::new(2);
    f.p.set_retention(0, ret(60, Some(10.0)));
    f.cache(0, 0.0);
    f.at(1.0).hit(0);
    f.p.set_retention(0, ret(70, Some(1.0)));
    f.cache(0, 2.0);
    assert_eq!(f.priority_of(0, before(3.0)), 70);
    assert_eq!(f.priority_of(0, 3.0), DEFAULT_PRIORITY);
}

#[test]
fn retention_change_on_a_cached_block_applies_now() {
    let mut f = Fixture::new(4);
    f.cache(0, 0.0);
    f.cache(1, 1.0);
    assert_eq!(f.order(2.0), vec![0, 1]);
    f.p.set_retention(0, ret(70, Some(2.0))); // at once, for 2 s from now: until 4.0
    assert_eq!(f.order(2.0), vec![1, 0]);
    assert_eq!(f.priority_of(0, 3.99), 70);
    assert_eq!(f.priority_of(0, 4.0), DEFAULT_PRIORITY);
    f.cache(2, 5.0);
    // Back at the default, 0 counts as released at its deadline 4.0: after 1 (1.0), before
    // 2 (5.0).
    assert_eq!(f.order(6.0), vec![1, 0, 2]);
    // Set to the default while cached, it has no deadline and is ranked by its release
    // time again (the reference's rule).
    f.p.set_retention(0, DEFAULT);
    assert_eq!(f.order(6.0), vec![0, 1, 2]);
    // Lowered, it goes first at once.
    f.p.set_retention(2, ret(0, None));
    assert_eq!(f.victim(6.0), Some(2));
}

#[test]
fn restore_undoes_a_hit() {
    let mut f = Fixture::new(4);
    f.p.set_retention(0, ret(80, Some(5.0)));
    f.cache(0, 0.0); // 80 until 5.0
    f.p.set_retention(2, ret(20, None));
    f.cache(2, 2.0);
    f.at(3.0).hit(0);
    // The failed call gave the revived block a retention of its own: undone too.
    f.p.set_retention(0, ret(95, None));
    f.at(4.0).restore(entry(0, "k0"));
    assert_eq!(f.retention(0), ret(80, Some(5.0)));
    f.cache(1, 5.5);
    assert_eq!(f.order(6.0), vec![2, 0, 1]); // 0 ran out at 5.0, before 1's release
                                             // A hit after it ran out resets it for good; restored, it has its old retention and
                                             // rank back.
    f.at(7.0).hit(0);
    assert_eq!(f.retention(0), DEFAULT);
    f.at(7.0).restore(entry(0, "k0"));
    assert_eq!(f.retention(0), ret(80, Some(5.0)));
    assert_eq!(f.order(7.0), vec![2, 0, 1]);
    // Not restored: released again, it is a default block released now.
    f.at(8.0).hit(0);
    f.cache(0, 9.0);
    assert_eq!(f.order(9.0), vec![2, 1, 0]);
    assert_eq!(f.priority_of(0, 100.0), DEFAULT_PRIORITY);
}

#[test]
fn removal_and_clear_forget_the_retention() {
    let mut f = Fixture::new(4);
    f.p.set_retention(0, ret(80, None));
    f.cache(0, 0.0);
    f.at(1.0).removed(0);
    assert_eq!(f.retention(0), DEFAULT);
    f.p.set_retention(1, ret(90, Some(3.0))); // held
    f.p.set_retention(2, ret(10, None));
    f.cache(2, 2.0);
    assert_eq!(f.p.clear().len(), 1);
    assert_eq!((f.retention(1), f.retention(2)), (DEFAULT, DEFAULT));
    f.cache(1, 3.0);
    f.cache(2, 4.0);
    f.cache(3, 4.0);
    assert_eq!(f.order(5.0), vec![1, 2, 3]);
}

/// The reference's ranks, computed from scratch (`priority.py`'s `_Entry.rank` and
/// `Priority`'s calls).
#[derive(Default)]
struct Model {
    seq: u64,
    retention: HashMap<u32, Retention>,
    /// block -> (priority, deadline, released, seq)
    cached: HashMap<u32, (u8, Option<f64>, f64, u64)>,
}

impl Model {
    fn retention(&self, b: u32) -> Retention {
        self.retention.get(&b).copied().unwrap_or(DEFAULT)
    }

    fn cached(&mut self, b: u32, now: f64) {
        let r = self.retention(b);
        self.cached
            .insert(b, (r.priority, deadline(r, now), now, self.seq));
        self.seq += 1;
    }

    fn hit(&mut self, b: u32, now: f64) {
        let (_, d, _, _) = self.cached.remove(&b).unwrap();
        if d.is_some_and(|d| d <= now) {
            self.retention.insert(b, DEFAULT);
        }
    }

    fn forget(&mut self, b: u32) {
        self.cached.remove(&b).unwrap();
        self.retention.remove(&b);
    }

    fn set_retention(&mut self, b: u32, r: Retention, now: f64) {
        if let Some(e) = self.cached.get_mut(&b) {
            e.0 = r.priority;
            e.1 = deadline(r, now);
        }
        self.retention.insert(b, r);
    }

    fn victim(&mut self, now: f64) -> Option<u32> {
        let rank = |&(p, d, released, seq): &(u8, Option<f64>, f64, u64)| match d {
            Some(d) if d <= now => (DEFAULT_PRIORITY, time_key(d), 0, seq),
            _ => (p, time_key(released), 1, seq),
        };
        let b = *self.cached.iter().min_by_key(|(_, e)| rank(e))?.0;
        self.forget(b);
        Some(b)
    }
}

fn random_retention(rng: &mut Rng) -> Retention {
    let priority = [0, 20, 35, 35, 50, 80, 100][rng.below(7) as usize];
    let duration = [None, None, Some(0.0), Some(0.5), Some(1.0), Some(3.0)];
    ret(priority, duration[rng.below(6) as usize])
}

/// Random calls on one clock to `a`, to the model (the victims must be the model's, each
/// cached block exactly once, none outside the set), and to `b`, which also takes hits
/// that it later restores, with a retention set meanwhile now and then, and time passing
/// (its victims must be `a`'s).
#[test]
fn random_sequences_match_the_model_and_restore_leaves_no_trace() {
    const N: u32 = 16;
    let clock = Arc::new(Clock::default());
    let mut now = 0.0;
    clock.set(now).unwrap();
    let mut a = PriorityPolicy::new(N as usize, &clock).unwrap();
    let mut b = PriorityPolicy::new(N as usize, &clock).unwrap();
    let mut model = Model::default();
    let mut rng = Rng(0x5eed_0f9a_110c_4700);
    let mut inside: HashMap<u32, Entry> = HashMap::new();
    let mut open: Vec<Entry> = Vec::new(); // hit in `b` only, to restore
    let (mut victims, mut expired_victims) = (0, 0);
    for step in 0..40_000u64 {
        now += [0.0, 0.0, 0.25, 0.5, 1.0][rng.below(5) as usize];
        clock.set(now).unwrap();
        let x = rng.below(u64::from(N)) as u32;
        let is_open = open.iter().any(|e| e.block == x);
        let free = inside.contains_key(&x) && !is_open;
        let op = rng.below(100);
        if op < 10 && !open.is_empty() {
            let i = rng.below(open.len() as u64) as usize;
            let e = open.swap_remove(i);
            b.restore(Entry {
                generation: e.generation + 1,
                ..e
            });
            let slot = |p: &PriorityPolicy| p.inner.rules.slots[e.block as usize].retention;
            assert_eq!(slot(&b), slot(&a), "step {step}");
        } else if op < 20 && free {
            open.push(inside[&x]);
            b.hit(x);
        } else if op < 25 && is_open {
            b.set_retention(x, random_retention(&mut rng)); // undone by the restore
        } else if op < 45 && !is_open {
            let r = random_retention(&mut rng);
            a.set_retention(x, r);
            b.set_retention(x, r);
            model.set_retention(x, r, now);
        } else if op < 62 && !inside.contains_key(&x) {
            let e = Entry {
                block: x,
                generation: step,
                digest: k(&format!("key{}", rng.below(3))),
            };
            a.cached(e);
            b.cached(e);
            model.cached(x, now);
            inside.insert(x, e);
        } else if op < 73 && free {
            a.hit(x);
            b.hit(x);
            model.hit(x, now);
            inside.remove(&x);
        } else if op < 76 && free {
            a.removed(x);
            b.removed(x);
            model.forget(x);
            inside.remove(&x);
        } else if op < 77 && open.is_empty() {
            let mut gone: Vec<u32> = a.clear().iter().map(|e| e.block).collect();
            gone.sort_unstable();
            b.clear();
            model = Model {
                seq: model.seq,
                ..Model::default()
            };
            let mut want: Vec<u32> = inside.drain().map(|(b, _)| b).collect();
            want.sort_unstable();
            assert_eq!(gone, want, "step {step}");
        } else if open.is_empty() {
            let want = model.victim(now);
            let va = a.victim();
            let vb = b.victim().map(|e| e.block);
            assert_eq!(va.map(|e| e.block), want, "step {step}");
            assert_eq!(vb, want, "step {step}");
            match va {
                None => assert!(inside.is_empty(), "step {step}"),
                Some(v) => {
                    let e = inside.remove(&v.block).expect("a victim outside the set");
                    assert_eq!((v.generation, v.digest), (e.generation, e.digest));
                    let expired = &a.inner.rules.slots[v.block as usize];
                    expired_victims += usize::from(expired.expired);
                    victims += 1;
                }
            }
        }
        assert_eq!(a.len(), inside.len(), "step {step}");
        assert_eq!(b.len() + open.len(), inside.len(), "step {step}");
        if step % 97 == 0 {
            let mut got: Vec<u32> = a.entries().iter().map(|e| e.block).collect();
            got.sort_unstable();
            let mut want: Vec<u32> = inside.keys().copied().collect();
            want.sort_unstable();
            assert_eq!(got, want, "step {step}");
        }
    }
    for e in open.drain(..) {
        b.restore(e);
    }
    let mut left: Vec<u32> = inside.keys().copied().collect();
    left.sort_unstable();
    let mut drained = Vec::new();
    while let Some(v) = a.victim() {
        assert_eq!(Some(v.block), model.victim(now));
        assert_eq!(b.victim().map(|e| e.block), Some(v.block));
        drained.push(v.block);
    }
    drained.sort_unstable();
    assert_eq!(drained, left);
    assert!(b.victim().is_none() && model.victim(now).is_none());
    assert!(victims > 2000, "only {victims} victims compared");
    eprintln!("{victims} victims, {expired_victims} of them expired");
    assert!(
        expired_victims > 150,
        "only {expired_victims} expired victims"
    );
}
