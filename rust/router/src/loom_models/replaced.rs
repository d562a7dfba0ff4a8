//! The replaced-holders protocol (`replaced.rs`): a writer short of slots, running
//! `Replaced::alloc_with` as `RouterIndex::alloc_slot` does, against a drop of replaced
//! holders that another thread has under way. The slots are `slots.rs`'s own `Slots` with a
//! limit of 1 or 2; a drop frees each slot as `RouterIndex::drop_taken` does (retire again,
//! then free; the bits it clears between are another model's concern, `lookup_word`).
//! Loom fails a model whose threads all block, so a lost wakeup of the waiting writer fails
//! too.

use super::{model, Seen};
use crate::error::RouterError;
use crate::replaced::{Replaced, Taken};
use crate::slots::{pack_meta, Slots};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

struct Fixture {
    slots: Slots,
    replaced: Replaced<u32>,
    /// How far the other thread's drop has come (std: an observation outside the model),
    /// stored just after each step: `QUEUED` (its take may have happened), `IN_FLIGHT` (taken;
    /// a writer whose allocation fails while it reads this knows the slot is not yet freed,
    /// so the drop has not ended), `ENDED`.
    drop_phase: std::sync::Arc<AtomicU32>,
}

const QUEUED: u32 = 0;
const IN_FLIGHT: u32 = 1;
const ENDED: u32 = 2;

impl Fixture {
    fn new(max_holders: usize) -> Arc<Self> {
        Arc::new(Self {
            slots: Slots::new(max_holders),
            replaced: Replaced::new(),
            drop_phase: Default::default(),
        })
    }

    /// A live holder's slot, as an applying call makes one.
    fn live_holder(&self, engine: u32) -> u32 {
        let s = self.slots.alloc(pack_meta(engine, 0, 0)).unwrap();
        self.slots.set_live(s);
        s
    }

    /// What `commit_snapshot_deferred` does to a holder the snapshot replaced: retired, then
    /// queued with its slot still taken.
    fn replace(&self, slot: u32) {
        self.slots.retire(slot);
        self.replaced.push(slot);
    }

    /// `drop_taken`: each set's slot retired again and freed; the drop ends when `taken` goes.
    fn drop_sets(&self, mut taken: Taken<'_, u32>) -> Vec<u32> {
        let sets = std::mem::take(&mut taken.sets);
        for &s in &sets {
            self.slots.retire(s);
            self.slots.free(s);
        }
        sets
    }

    /// `drop_replaced` on another thread, its progress recorded in `drop_phase`.
    fn drop_queued(&self) -> Vec<u32> {
        let taken = self.replaced.take();
        self.drop_phase.store(IN_FLIGHT, SeqCst);
        let sets = self.drop_sets(taken);
        self.drop_phase.store(ENDED, SeqCst);
        sets
    }

    /// `alloc_slot` for a new holder; `failed_at` gets the drop's phase at each failed
    /// attempt, `dropped` what the writer dropped itself, with the drop's phase then.
    fn writer(
        &self,
        failed_at: &mut Vec<u32>,
        dropped: &mut Vec<(Vec<u32>, u32)>,
    ) -> Result<u32, RouterError> {
        self.replaced.alloc_with(
            || {
                let got = self.slots.alloc(pack_meta(9, 0, 0));
                if got.is_err() {
                    failed_at.push(self.drop_phase.load(SeqCst));
                }
                got
            },
            |taken| {
                let sets = self.drop_sets(taken);
                dropped.push((sets, self.drop_phase.load(SeqCst)));
            },
        )
    }
}

/// The race CI hit: the only slot is held by a replaced holder that another thread is
/// dropping. Whether the writer's attempt fails before that drop takes the set, while it is
/// in flight, or after it ended, the writer gets the slot: never `TooManyHolders`. Outcomes
/// required: the writer took the set and dropped it itself; its attempt failed before the
/// drop was seen in flight and it dropped nothing (it waited for the drop, or found it ended
/// since); an attempt failed while the drop was in flight.
#[test]
fn a_writer_short_of_slots_gets_the_one_a_replaced_holder_frees() {
    const TOOK_IT_ITSELF: u32 = 0;
    const FAILED_EARLY_THEN_GOT_THE_FREED_SLOT: u32 = 1;
    const FAILED_WHILE_IN_FLIGHT: u32 = 2;
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || {
        let fx = Fixture::new(1);
        let old = fx.live_holder(1);
        fx.replace(old);
        let dropper = {
            let fx = fx.clone();
            thread::spawn(move || fx.drop_queued())
        };
        let (mut failed_at, mut dropped) = (Vec::new(), Vec::new());
        let got = fx.writer(&mut failed_at, &mut dropped);
        let by_dropper = dropper.join().unwrap();
        assert_eq!(
            got.expect("refused while a replaced holder held the slot"),
            old
        );
        // The set was dropped once, by one of the two.
        let by_writer: Vec<u32> = dropped.iter().flat_map(|(s, _)| s.clone()).collect();
        assert_eq!([by_writer.clone(), by_dropper].concat(), vec![old]);
        assert_eq!(fx.slots.in_use(), 1);
        assert_eq!(fx.replaced.with_settled(<[u32]>::len), 0);
        if !by_writer.is_empty() {
            s.saw(TOOK_IT_ITSELF);
        } else if failed_at.contains(&QUEUED) {
            s.saw(FAILED_EARLY_THEN_GOT_THE_FREED_SLOT);
        }
        if failed_at.contains(&IN_FLIGHT) {
            s.saw(FAILED_WHILE_IN_FLIGHT);
        }
    });
    seen.assert_saw(&[
        TOOK_IT_ITSELF,
        FAILED_EARLY_THEN_GOT_THE_FREED_SLOT,
        FAILED_WHILE_IN_FLIGHT,
    ]);
}

/// Two slots, both taken: one by a replaced holder another thread is dropping, one by a live
/// holder that a commit on a third thread replaces (retire, push) while the writer may be
/// waiting for the drop.
/// The writer gets a slot either way: the pushed set, taken and dropped at once, or the slot
/// the drop in flight frees (both outcomes required). Every slot is accounted for at the end:
/// the writer's, and those of sets still queued. (That the push wakes a waiting writer
/// without the drop ending is the next model's.)
#[test]
fn a_commit_racing_a_drop_and_a_writer_short_of_slots() {
    const TOOK_THE_PUSHED_SET_WHILE_A_WAS_TAKEN: u32 = 0;
    const GOT_THE_DROPPED_SLOT: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(4), move || {
        let fx = Fixture::new(2);
        let a = fx.live_holder(1);
        let b = fx.live_holder(2);
        fx.replace(a);
        let dropper = {
            let fx = fx.clone();
            thread::spawn(move || fx.drop_queued())
        };
        let committer = {
            let fx = fx.clone();
            thread::spawn(move || fx.replace(b))
        };
        let (mut failed_at, mut dropped) = (Vec::new(), Vec::new());
        let got = fx
            .writer(&mut failed_at, &mut dropped)
            .expect("refused while replaced holders held the slots");
        let by_dropper = dropper.join().unwrap();
        committer.join().unwrap();
        let queued = fx.replaced.with_settled(<[u32]>::to_vec);
        let by_writer: Vec<u32> = dropped.iter().flat_map(|(s, _)| s.clone()).collect();
        // Each replaced slot dropped once or still queued; the writer holds one more.
        let mut all = [by_writer, by_dropper, queued.clone()].concat();
        all.sort_unstable();
        assert_eq!(all, vec![a, b]);
        assert!(!queued.contains(&got));
        assert_eq!(fx.slots.in_use(), 1 + queued.len());
        // The writer took b alone after a failed attempt: the other thread had taken a.
        if dropped.iter().any(|(s, _)| s == &vec![b]) && !failed_at.is_empty() {
            s.saw(TOOK_THE_PUSHED_SET_WHILE_A_WAS_TAKEN);
        }
        if dropped.iter().all(|(s, _)| s.is_empty()) && !failed_at.is_empty() {
            s.saw(GOT_THE_DROPPED_SLOT);
        }
    });
    seen.assert_saw(&[TOOK_THE_PUSHED_SET_WHILE_A_WAS_TAKEN, GOT_THE_DROPPED_SLOT]);
}

/// A set pushed while the writer waits for a drop in flight is handed to it at once, without
/// waiting for that drop to end: the drop here does not end until the writer has its slot
/// (standing for a drop of millions of blocks). Two slots: the drop in flight holds one (the
/// writer starts once it is taken), the other holder is replaced (retired, pushed) by the
/// dropping thread after its take, so the writer either finds it queued or waits and is woken
/// by the push. A push that did not wake it would leave the writer blocked for good and the
/// dropper spinning: loom fails the model (it does, past its branch limit, with `push`'s
/// `notify_all` removed).
#[test]
fn a_set_pushed_while_the_writer_waits_is_handed_over_at_once() {
    model(None, move || {
        let fx = Fixture::new(2);
        let a = fx.live_holder(1);
        let b = fx.live_holder(2);
        fx.replace(a);
        let took = Arc::new(AtomicBool::new(false));
        let writer_done = Arc::new(AtomicBool::new(false));
        let dropper = {
            let (fx, took, writer_done) = (fx.clone(), took.clone(), writer_done.clone());
            thread::spawn(move || {
                let taken = fx.replaced.take();
                assert_eq!(taken.sets, vec![a]);
                took.store(true, Ordering::Release);
                fx.replace(b);
                while !writer_done.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                fx.drop_sets(taken)
            })
        };
        while !took.load(Ordering::Acquire) {
            thread::yield_now();
        }
        let (mut failed_at, mut dropped) = (Vec::new(), Vec::new());
        let got = fx
            .writer(&mut failed_at, &mut dropped)
            .expect("refused while replaced holders held the slots");
        writer_done.store(true, Ordering::Release);
        assert_eq!(dropper.join().unwrap(), vec![a]);
        // The writer dropped b itself and took its slot; a's drop freed the other.
        assert_eq!(got, b);
        let by_writer: Vec<Vec<u32>> = dropped.into_iter().map(|(s, _)| s).collect();
        assert_eq!(by_writer, vec![vec![b]]);
        assert_eq!(failed_at.len(), 1, "both slots were taken, once");
        assert_eq!(fx.slots.in_use(), 1);
    });
}
