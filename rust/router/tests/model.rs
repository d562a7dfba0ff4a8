//! The index against a plain model (per engine: per (medium, group), a HashSet of hashes) on
//! random operations: every lookup answers as the model does, counters agree, invariants hold.

use pagedkv_router::{Config, EngineKey, Event, RouterError, RouterIndex};
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap, HashSet};

const MEDIA: [&str; 2] = ["GPU", "CPU"];

#[derive(Debug, Clone)]
enum Op {
    Store {
        engine: u8,
        medium: usize,
        group: u16,
        hashes: Vec<u64>,
        parent: Option<u64>,
        staged: bool,
    },
    Remove {
        engine: u8,
        medium: usize,
        group: u16,
        hashes: Vec<u64>,
        staged: bool,
    },
    Clear {
        engine: u8,
        staged: bool,
    },
    RemoveEngine(u8),
    Begin(u8),
    Commit(u8),
    Abort(u8),
    Match(Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = prop::collection::vec(0u64..12, 1..5);
    prop_oneof![
        6 => (0u8..4, 0usize..2, 0u16..2, hashes.clone(), prop::option::of(0u64..12), prop::bool::weighted(0.2))
            .prop_map(|(engine, medium, group, hashes, parent, staged)| Op::Store { engine, medium, group, hashes, parent, staged }),
        3 => (0u8..4, 0usize..2, 0u16..2, hashes, prop::bool::weighted(0.2))
            .prop_map(|(engine, medium, group, hashes, staged)| Op::Remove { engine, medium, group, hashes, staged }),
        1 => (0u8..4, prop::bool::weighted(0.2)).prop_map(|(engine, staged)| Op::Clear { engine, staged }),
        1 => (0u8..4).prop_map(Op::RemoveEngine),
        1 => (0u8..4).prop_map(Op::Begin),
        1 => (0u8..4).prop_map(Op::Commit),
        1 => (0u8..4).prop_map(Op::Abort),
        4 => prop::collection::vec(0u64..12, 0..7).prop_map(Op::Match),
    ]
}

type Sets = HashMap<(usize, u16), HashSet<u64>>;

#[derive(Default)]
struct Engine {
    live: Sets,
    staged: Option<Sets>,
}

#[derive(Default)]
struct Model {
    engines: HashMap<u8, Engine>,
    orphans: u64,
    duplicates: u64,
    unknown_removals: u64,
}

fn key(e: u8) -> EngineKey {
    EngineKey::Int(u64::from(e))
}

impl Model {
    /// An engine's live sets (it is created if unknown), or its staged ones (None without a
    /// snapshot begun; an unknown engine is not created by a refused call).
    fn sets(&mut self, e: u8, staged: bool) -> Option<&mut Sets> {
        if staged {
            return self.engines.get_mut(&e)?.staged.as_mut();
        }
        Some(&mut self.engines.entry(e).or_default().live)
    }

    fn answer(&self, keys: &[u64]) -> BTreeSet<(u64, usize, u16, u32)> {
        let mut out = BTreeSet::new();
        for (&e, eng) in &self.engines {
            for (&(m, g), set) in &eng.live {
                let n = keys.iter().take_while(|k| set.contains(k)).count();
                if n > 0 {
                    out.insert((u64::from(e), m, g, n as u32));
                }
            }
        }
        out
    }

    fn memberships(&self) -> u64 {
        self.engines
            .values()
            .flat_map(|e| e.live.values())
            .map(|s| s.len() as u64)
            .sum()
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let ix = RouterIndex::<u64>::new(Config {
        max_holders: 64,
        log_slack: 2,
    });
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Store {
                engine,
                medium,
                group,
                hashes,
                parent,
                staged,
            } => {
                let ev = [Event::Stored {
                    hashes: hashes.clone(),
                    parent,
                    medium: Some(MEDIA[medium]),
                    group,
                }];
                let r = if staged {
                    ix.apply_staged(&key(engine), &ev)
                } else {
                    ix.apply(&key(engine), &ev)
                };
                match m.sets(engine, staged) {
                    None => prop_assert!(matches!(r, Err(RouterError::Snapshot(_)))),
                    Some(sets) => {
                        r.unwrap();
                        let set = sets.entry((medium, group)).or_default();
                        let orphan = parent.is_some_and(|p| !set.contains(&p));
                        let mut dups = 0;
                        for h in hashes {
                            dups += u64::from(!set.insert(h));
                        }
                        m.orphans += u64::from(orphan);
                        m.duplicates += dups;
                    }
                }
            }
            Op::Remove {
                engine,
                medium,
                group,
                hashes,
                staged,
            } => {
                let ev = [Event::Removed {
                    hashes: hashes.clone(),
                    medium: Some(MEDIA[medium]),
                    group,
                }];
                let r = if staged {
                    ix.apply_staged(&key(engine), &ev)
                } else {
                    ix.apply(&key(engine), &ev)
                };
                match m.sets(engine, staged) {
                    None => prop_assert!(r.is_err()),
                    Some(sets) => {
                        r.unwrap();
                        let mut unknown = 0;
                        let set = sets.entry((medium, group)).or_default();
                        for h in hashes {
                            unknown += u64::from(!set.remove(&h));
                        }
                        m.unknown_removals += unknown;
                    }
                }
            }
            Op::Clear { engine, staged } => {
                let ev = [Event::Cleared];
                let r = if staged {
                    ix.apply_staged(&key(engine), &ev)
                } else {
                    ix.apply(&key(engine), &ev)
                };
                match m.sets(engine, staged) {
                    None => prop_assert!(r.is_err()),
                    Some(sets) => {
                        r.unwrap();
                        sets.values_mut().for_each(HashSet::clear);
                    }
                }
            }
            Op::RemoveEngine(e) => {
                prop_assert_eq!(ix.remove_engine(&key(e)), m.engines.remove(&e).is_some());
            }
            Op::Begin(e) => {
                ix.begin_snapshot(&key(e));
                m.engines.entry(e).or_default().staged = Some(Sets::new());
            }
            Op::Commit(e) => {
                let r = ix.commit_snapshot(&key(e));
                match m
                    .engines
                    .get_mut(&e)
                    .and_then(|eng| eng.staged.take().map(|s| (eng, s)))
                {
                    None => prop_assert!(r.is_err()),
                    Some((eng, s)) => {
                        r.unwrap();
                        eng.live = s;
                    }
                }
            }
            Op::Abort(e) => {
                ix.abort_snapshot(&key(e));
                if let Some(eng) = m.engines.get_mut(&e) {
                    eng.staged = None;
                }
            }
            Op::Match(keys) => {
                let got: BTreeSet<_> = ix
                    .match_prefix(&keys)
                    .into_iter()
                    .map(|h| {
                        let EngineKey::Int(e) = h.engine else {
                            unreachable!()
                        };
                        let name = ix.medium_name(h.medium).unwrap().unwrap();
                        let mi = MEDIA.iter().position(|&x| x == name).unwrap();
                        (e, mi, h.group, h.blocks)
                    })
                    .collect();
                prop_assert_eq!(got, m.answer(&keys));
            }
        }
        if let Err(e) = ix.check_invariants() {
            return Err(TestCaseError::fail(e));
        }
        let s = ix.stats();
        prop_assert_eq!(s.memberships, m.memberships());
        prop_assert_eq!(s.engines, m.engines.len());
        prop_assert_eq!(
            (s.orphans, s.duplicates, s.unknown_removals),
            (m.orphans, m.duplicates, m.unknown_removals)
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_answers_as_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}
