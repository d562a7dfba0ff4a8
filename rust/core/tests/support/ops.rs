//! Operation sequences over one `BlockManager`, checked step by step against a model of what
//! every GPU and CPU block holds. One interpreter for three drivers: the proptest
//! state-machine test (`tests/model.rs`), the cargo-fuzz target (`fuzz/fuzz_targets/ops.rs`)
//! and the replay of the fuzz corpus (`tests/fuzz_corpus.rs`).
//!
//! The model is the engine's view of KV memory: a block "holds" the prefix of the sequence that
//! last wrote it (salt and tokens up to the block's end). The manager decides block ids; the
//! model follows them as an engine would (prefill writes the computed blocks, chunk by chunk
//! with extend, copy-on-write and swap pairs are copied, decode writes the last block, truncate
//! drops tokens) and checks, after every step, that each live sequence's table points at
//! blocks holding exactly its own scheduled prefix. An aborted step schedules tokens, writes
//! nothing and frees the sequence with only its earlier tokens computed: a later prefix hit
//! on a block whose KV was never written is a content mismatch. So a wrong prefix hit
//! (including one through a digest collision), a block handed to two owners, a missed
//! copy-on-write or a lost swap shows up as a content mismatch, on top of `check_invariants`.
//! Every refused call (error or `None`) must leave the observable state unchanged.
//!
//! Encoding (what the fuzzer mutates): byte 0..4 choose the configuration, then every 4 bytes
//! are one operation `[opcode, a, b, c]`. Any byte string is a valid program.
#![allow(dead_code)]

use pagedkv_core::{BlockHasher, BlockManager, Config, Error, EvictionKind, HashAlgo, Stats};
use std::collections::BTreeMap;

/// What a block holds: the salt flag and the tokens of the prefix up to the block's end.
type Content = (bool, Vec<u32>);

#[derive(Debug, Clone)]
pub struct Setup {
    pub num_blocks: u32,
    pub block_size: usize,
    pub num_cpu_blocks: u32,
    pub caching: bool,
    pub algo: HashAlgo,
    /// The eviction policy (locked mode for all but LRU), and tenants (locked LRU too).
    pub eviction: EvictionKind,
    pub tenants: bool,
}

impl Setup {
    pub fn decode(b: [u8; 4]) -> Self {
        Self {
            num_blocks: 3 + u32::from(b[0] % 22),
            block_size: 1 + usize::from(b[1] % 4),
            num_cpu_blocks: u32::from(b[2] % 9),
            caching: b[3] % 5 != 0,
            algo: match (b[3] / 5) % 3 {
                0 => HashAlgo::Sha256,
                1 => HashAlgo::Xxh3_128,
                // Every block shares its digest with 1/256 of all others: collisions galore.
                _ => HashAlgo::Xxh3Trunc8,
            },
            eviction: EvictionKind::ALL[usize::from(b[0] / 22) % EvictionKind::ALL.len()],
            tenants: b[2] / 9 % 2 == 1,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// Prompt = first `len` tokens of shared prompt `prompt`, then `tail` tokens of its own.
    Allocate {
        seq: u64,
        prompt: u8,
        len: u8,
        tail: u8,
        salt: bool,
        lookahead: u8,
        /// Prompt tokens scheduled past the hit (chunked prefill); 0: all of them.
        chunk: u8,
    },
    Append {
        seq: u64,
        count: u8,
        token: u8,
        lookahead: u8,
    },
    /// Schedule the next `count` prompt tokens (`fit`: at most what is left).
    Extend {
        seq: u64,
        count: u8,
        fit: bool,
        lookahead: u8,
    },
    /// Drop the last `back` tokens.
    Truncate {
        seq: u64,
        back: u8,
    },
    /// Schedule `count` more tokens (extend, or append when the prompt is scheduled), but
    /// the step never runs: no KV is written, and the sequence is freed with only its
    /// earlier tokens computed.
    Abort {
        seq: u64,
        count: u8,
    },
    /// One token to each sequence whose bit is set in `mask` (may name unknown ones).
    AppendBatch {
        mask: u8,
        token: u8,
    },
    Fork {
        parent: u64,
        child: u64,
    },
    Free {
        seq: u64,
    },
    FreeBatch {
        mask: u8,
    },
    SwapOut {
        seq: u64,
    },
    SwapIn {
        seq: u64,
    },
    Reset,
}

/// Sequence ids 0..8: small enough that ops keep meeting the same sequences.
fn id(b: u8) -> u64 {
    u64::from(b % 8)
}

impl Op {
    pub fn decode(b: [u8; 4]) -> Self {
        let [op, a, x, y] = b;
        match op % 20 {
            0..=2 => Op::Allocate {
                seq: id(a),
                prompt: x % 3,
                len: x / 3 % 24,
                tail: y % 9,
                salt: y & 0x80 != 0,
                lookahead: (y >> 4) % 4,
                chunk: 0,
            },
            16 => Op::Allocate {
                seq: id(a),
                prompt: x % 3,
                len: x / 3 % 24,
                tail: y % 9,
                salt: false,
                lookahead: 0,
                chunk: 1 + (y >> 4) % 8,
            },
            3..=5 => Op::Append {
                seq: id(a),
                count: 1 + x % 6,
                token: y,
                lookahead: (y >> 4) % 3,
            },
            17 => Op::Extend {
                seq: id(a),
                count: 1 + x % 8,
                fit: x & 0x80 != 0,
                lookahead: y % 3,
            },
            18 => Op::Truncate {
                seq: id(a),
                back: x % 6,
            },
            19 => Op::Abort {
                seq: id(a),
                count: 1 + x % 6,
            },
            6 | 7 => Op::AppendBatch { mask: a, token: x },
            8 => Op::Fork {
                parent: id(a),
                child: id(x),
            },
            9 | 10 => Op::Free { seq: id(a) },
            11 => Op::FreeBatch { mask: a },
            12 => Op::SwapOut { seq: id(a) },
            13 => Op::SwapIn { seq: id(a) },
            14 => Op::Reset,
            _ => Op::Append {
                seq: id(a),
                count: 1,
                token: y,
                lookahead: 0,
            },
        }
    }
}

/// Decode a fuzz input: configuration, then operations.
pub fn decode(data: &[u8]) -> (Setup, Vec<Op>) {
    let mut head = [0u8; 4];
    for (h, b) in head.iter_mut().zip(data) {
        *h = *b;
    }
    let ops = data
        .get(4..)
        .unwrap_or(&[])
        .chunks_exact(4)
        .map(|c| Op::decode([c[0], c[1], c[2], c[3]]))
        .collect();
    (Setup::decode(head), ops)
}

/// Run a fuzz input; panics on the first violation.
pub fn run_bytes(data: &[u8]) -> Report {
    let (setup, ops) = decode(data);
    run(&setup, &ops)
}

/// What a run did, for tests that want to see the workload was not trivial.
#[derive(Debug, Default, Clone, Copy)]
pub struct Report {
    pub steps: usize,
    pub refused: usize,
    pub errors: usize,
    pub hit_tokens: usize,
}

#[derive(Debug, Clone)]
struct SeqModel {
    tokens: Vec<u32>,
    /// Tokens scheduled (and, in this model, computed: their KV written).
    scheduled: usize,
    salt: bool,
    /// GPU table; empty while swapped.
    table: Vec<u32>,
    /// `Some(cpu blocks)` while swapped.
    cpu: Option<Vec<u32>>,
}

impl SeqModel {
    /// What block `i` must hold: the KV of the scheduled prefix up to the block's end.
    fn content(&self, i: usize, bs: usize) -> Content {
        let end = ((i + 1) * bs).min(self.scheduled);
        (self.salt, self.tokens[..end].to_vec())
    }
    /// Blocks that hold scheduled tokens (lookahead blocks beyond them hold nothing yet).
    fn written(&self, bs: usize) -> usize {
        self.scheduled.div_ceil(bs)
    }
}

/// Whether a block holding `held` serves `want`: the same salt and the rows `want` needs
/// written for the same prefix. Rows past them may hold anything (a block left partial by
/// `truncate` keeps its old rows); a full `want` therefore needs exactly `want`.
fn serves(held: Option<&Content>, want: &Content) -> bool {
    held.is_some_and(|(salt, t)| {
        *salt == want.0 && t.len() >= want.1.len() && t[..want.1.len()] == want.1[..]
    })
}

struct Runner {
    m: BlockManager,
    setup: Setup,
    hasher: BlockHasher,
    seqs: BTreeMap<u64, SeqModel>,
    gpu: Vec<Option<Content>>,
    cpu: Vec<Option<Content>>,
    /// Three shared prompts (long enough for 24 tokens), so that prompts share prefixes.
    shared: [Vec<u32>; 3],
    fresh: u32,
    report: Report,
}

type Snapshot = (Stats, Vec<(u64, usize, usize, bool, Vec<u32>)>);

pub fn run(setup: &Setup, ops: &[Op]) -> Report {
    let mut config = Config::new(setup.num_blocks, setup.block_size);
    config.num_cpu_blocks = setup.num_cpu_blocks;
    config.enable_prefix_caching = setup.caching;
    config.hash_algo = setup.algo;
    config.eviction = setup.eviction;
    config.tenants = setup.tenants;
    let mut r = Runner {
        m: BlockManager::new(config).expect("valid setup"),
        setup: setup.clone(),
        hasher: BlockHasher::new(setup.algo, 0),
        seqs: BTreeMap::new(),
        gpu: vec![None; setup.num_blocks as usize],
        cpu: vec![None; setup.num_cpu_blocks as usize],
        shared: [
            (0..24).map(|t| t % 5).collect(),
            (0..24).map(|t| 100 + t).collect(),
            (0..24)
                .map(|t| if t < 8 { t % 5 } else { 200 + t })
                .collect(),
        ],
        fresh: 1000,
        report: Report::default(),
    };
    for (step, op) in ops.iter().enumerate() {
        r.apply(*op);
        r.check(step, op);
        r.report.steps += 1;
    }
    r.report
}

impl Runner {
    fn bs(&self) -> usize {
        self.setup.block_size
    }

    fn snapshot(&self) -> Snapshot {
        let seqs = self
            .seqs
            .keys()
            .map(|&id| {
                let n = self.m.num_tokens(id).unwrap();
                let scheduled = self.m.num_scheduled_tokens(id).unwrap();
                let swapped = self.m.is_swapped(id).unwrap();
                let table = if swapped {
                    vec![]
                } else {
                    self.m.block_table(id).unwrap()
                };
                (id, n, scheduled, swapped, table)
            })
            .collect();
        (self.m.stats(), seqs)
    }

    /// A refused call: `None` or an error, and nothing changed.
    fn refused<T: std::fmt::Debug>(&mut self, before: &Snapshot, what: &str, out: &T) {
        assert_eq!(
            &self.snapshot(),
            before,
            "{what} -> {out:?} changed the state"
        );
        self.report.refused += 1;
    }

    fn expect_err<T: std::fmt::Debug>(
        &mut self,
        before: &Snapshot,
        out: Result<T, Error>,
        want: &Error,
    ) {
        match out {
            Err(e) if std::mem::discriminant(&e) == std::mem::discriminant(want) => {
                self.refused(before, "an error", &e);
                self.report.errors += 1;
            }
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }

    /// The error a call on `id` must raise given the model, if any.
    fn fault(&self, id: u64, needs_resident: bool) -> Option<Error> {
        match self.seqs.get(&id) {
            None => Some(Error::UnknownSequence(id)),
            Some(s) if needs_resident && s.cpu.is_some() => Some(Error::Swapped(id)),
            _ => None,
        }
    }

    fn write(&mut self, id: u64, blocks: std::ops::Range<usize>) {
        let bs = self.bs();
        let s = &self.seqs[&id];
        for i in blocks {
            self.gpu[s.table[i] as usize] = Some(s.content(i, bs));
        }
    }

    fn prompt(&mut self, prompt: u8, len: u8, tail: u8) -> Vec<u32> {
        let mut tokens = self.shared[usize::from(prompt)][..usize::from(len)].to_vec();
        for _ in 0..tail {
            self.fresh += 1;
            tokens.push(self.fresh % 7);
        }
        if tokens.is_empty() {
            tokens.push(0);
        }
        tokens
    }

    fn apply(&mut self, op: Op) {
        let before = self.snapshot();
        let bs = self.bs();
        match op {
            Op::Allocate {
                seq,
                prompt,
                len,
                tail,
                salt,
                lookahead,
                chunk,
            } => {
                let tokens = self.prompt(prompt, len, tail);
                let salt_bytes = salt.then_some(&b"tenant"[..]);
                let n = tokens.len();
                let chunk = usize::from(chunk).min(n);
                let new = (chunk > 0).then_some(chunk);
                let mut owned = tokens.clone();
                let out =
                    self.m
                        .allocate_from(seq, &mut owned, salt_bytes, None, new, lookahead.into());
                if self.seqs.contains_key(&seq) {
                    return self.expect_err(&before, out, &Error::DuplicateSequence(seq));
                }
                let Some(hit) = out.expect("allocate") else {
                    return self.refused(&before, "allocate", &None::<()>);
                };
                assert!(hit % bs == 0 && (hit == 0 || hit < n), "hit {hit} of {n}");
                let scheduled = (hit + new.unwrap_or(n)).min(n);
                let table = self.m.block_table(seq).unwrap();
                assert_eq!(
                    table.len(),
                    (scheduled + usize::from(lookahead)).div_ceil(bs)
                );
                let model = SeqModel {
                    tokens,
                    scheduled,
                    salt,
                    table,
                    cpu: None,
                };
                // The hit blocks are read, not computed: they must hold this very prefix.
                for i in 0..hit / bs {
                    let held = &self.gpu[model.table[i] as usize];
                    assert_eq!(
                        held.as_ref(),
                        Some(&model.content(i, bs)),
                        "prefix hit on block {} serves KV never written for this prefix",
                        model.table[i]
                    );
                }
                let written = model.written(bs);
                self.seqs.insert(seq, model);
                self.write(seq, hit / bs..written);
                self.report.hit_tokens += hit;
            }
            Op::Append {
                seq,
                count,
                token,
                lookahead,
            } => {
                let tokens = vec![u32::from(token % 4); usize::from(count)];
                let out = self.m.append_lookahead(seq, &tokens, lookahead.into());
                if let Some(e) = self.fault(seq, true) {
                    return self.expect_err(&before, out, &e);
                }
                if self.unscheduled(seq) > 0 {
                    return self.expect_err(&before, out, &Error::InvalidArgument(String::new()));
                }
                match out.expect("append") {
                    None => self.refused(&before, "append", &()),
                    Some(pairs) => self.appended(&[(seq, tokens)], &pairs),
                }
            }
            Op::AppendBatch { mask, token } => {
                let ids: Vec<u64> = (0..8).filter(|b| mask >> b & 1 == 1).collect();
                let tokens: Vec<u32> = ids
                    .iter()
                    .map(|&i| (u32::from(token) + i as u32) % 4)
                    .collect();
                let out = self.m.append_batch(&ids, &tokens);
                let fault = ids.iter().find_map(|&i| {
                    self.fault(i, true).or_else(|| {
                        (self.unscheduled(i) > 0).then(|| Error::InvalidArgument(String::new()))
                    })
                });
                if let Some(e) = fault {
                    // Which of several faults is reported is unspecified: any refusal will do.
                    return match out {
                        Err(_) => {
                            self.refused(&before, "append_batch", &e);
                            self.report.errors += 1;
                        }
                        Ok(v) => panic!("append_batch with {e:?} returned {v:?}"),
                    };
                }
                match out.expect("append_batch") {
                    None => self.refused(&before, "append_batch", &()),
                    Some(pairs) => {
                        let each: Vec<_> =
                            ids.iter().zip(tokens).map(|(&i, t)| (i, vec![t])).collect();
                        self.appended(&each, &pairs);
                    }
                }
            }
            Op::Extend {
                seq,
                count,
                fit,
                lookahead,
            } => {
                let left = self.unscheduled(seq);
                let k = if fit {
                    usize::from(count).min(left.max(1))
                } else {
                    usize::from(count)
                };
                let out = self.m.extend(seq, k, lookahead.into());
                if let Some(e) = self.fault(seq, true) {
                    return self.expect_err(&before, out, &e);
                }
                if k > left {
                    return self.expect_err(&before, out, &Error::InvalidArgument(String::new()));
                }
                match out.expect("extend") {
                    None => self.refused(&before, "extend", &()),
                    Some(pairs) => self.scheduled_more(seq, k, &pairs, true),
                }
            }
            Op::Truncate { seq, back } => {
                let n = self.seqs.get(&seq).map_or(0, |s| s.tokens.len());
                let m = n.saturating_sub(usize::from(back));
                let out = self.m.truncate(seq, m);
                if let Some(e) = self.fault(seq, true) {
                    return self.expect_err(&before, out, &e);
                }
                if m == 0 {
                    return self.expect_err(&before, out, &Error::InvalidArgument(String::new()));
                }
                let Some(pairs) = out.expect("truncate") else {
                    return self.refused(&before, "truncate", &());
                };
                self.copy(&pairs);
                let table = self.m.block_table(seq).unwrap();
                let s = self.seqs.get_mut(&seq).unwrap();
                let last = m / bs;
                assert_eq!(table.len(), m.div_ceil(bs).min(s.table.len()));
                for (i, (a, b)) in s.table.iter().zip(&table).enumerate() {
                    if a != b {
                        assert!(i == last && pairs == [(*a, *b)], "truncate moved entry {i}");
                    }
                }
                s.tokens.truncate(m);
                s.scheduled = s.scheduled.min(m);
                s.table = table;
            }
            Op::Abort { seq, count } => {
                if self.fault(seq, true).is_some() {
                    // Not resident: the abort is only the free (retracting nothing).
                    let out = self.m.free_computed(seq, Some(0));
                    if let Some(e) = self.fault(seq, false) {
                        return self.expect_err(&before, out, &e);
                    }
                    out.expect("free of a swapped sequence");
                    self.seqs.remove(&seq);
                    return;
                }
                let left = self.unscheduled(seq);
                let computed = self.seqs[&seq].scheduled;
                let out = if left > 0 {
                    self.m.extend(seq, usize::from(count).min(left), 0)
                } else {
                    self.m.append(seq, &vec![3; usize::from(count)])
                };
                let Some(pairs) = out.expect("the aborted step's scheduling") else {
                    return self.refused(&before, "abort's schedule", &());
                };
                // The pairs were copied (that is the caller's part of the call), but the
                // step that writes the new tokens' KV never ran.
                self.copy(&pairs);
                self.m.free_computed(seq, Some(computed)).expect("free");
                self.seqs.remove(&seq);
            }
            Op::Fork { parent, child } => {
                let out = self.m.fork(parent, child);
                if let Some(e) = self.fault(parent, true) {
                    return self.expect_err(&before, out, &e);
                }
                if self.seqs.contains_key(&child) {
                    return self.expect_err(&before, out, &Error::DuplicateSequence(child));
                }
                out.expect("fork");
                let copy = self.seqs[&parent].clone();
                self.seqs.insert(child, copy);
            }
            Op::Free { seq } => {
                let out = self.m.free(seq);
                if let Some(e) = self.fault(seq, false) {
                    return self.expect_err(&before, out, &e);
                }
                out.expect("free");
                self.seqs.remove(&seq);
            }
            Op::FreeBatch { mask } => {
                let ids: Vec<u64> = (0..8).filter(|b| mask >> b & 1 == 1).collect();
                let out = self.m.free_batch(&ids);
                if let Some(e) = ids.iter().find_map(|&i| self.fault(i, false)) {
                    return self.expect_err(&before, out, &e);
                }
                out.expect("free_batch");
                ids.iter().for_each(|i| {
                    self.seqs.remove(i);
                });
            }
            Op::SwapOut { seq } => {
                let out = self.m.swap_out(seq);
                if let Some(e) = self.fault(seq, true) {
                    return self.expect_err(&before, out, &e);
                }
                let Some(pairs) = out.expect("swap_out") else {
                    return self.refused(&before, "swap_out", &());
                };
                let s = self.seqs.get_mut(&seq).unwrap();
                assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), s.table);
                for &(g, c) in &pairs {
                    self.cpu[c as usize] = self.gpu[g as usize].clone();
                }
                s.cpu = Some(pairs.iter().map(|p| p.1).collect());
                s.table.clear();
            }
            Op::SwapIn { seq } => {
                let out = self.m.swap_in(seq);
                match self.seqs.get(&seq) {
                    None => return self.expect_err(&before, out, &Error::UnknownSequence(seq)),
                    Some(s) if s.cpu.is_none() => {
                        return self.expect_err(&before, out, &Error::NotSwapped(seq))
                    }
                    _ => {}
                }
                let Some(pairs) = out.expect("swap_in") else {
                    return self.refused(&before, "swap_in", &());
                };
                let s = self.seqs.get_mut(&seq).unwrap();
                assert_eq!(
                    pairs.iter().map(|p| p.0).collect::<Vec<_>>(),
                    s.cpu.take().unwrap()
                );
                for &(c, g) in &pairs {
                    self.gpu[g as usize] = self.cpu[c as usize].clone();
                }
                s.table = pairs.iter().map(|p| p.1).collect();
            }
            Op::Reset => {
                let owned = self.seqs.values().any(|s| !s.table.is_empty());
                let done = self.m.reset_prefix_cache().unwrap();
                assert_eq!(
                    done, !owned,
                    "reset must succeed exactly when no block is owned"
                );
                if !done {
                    self.refused(&before, "reset_prefix_cache", &done);
                }
            }
        }
    }

    /// Prompt tokens of `id` not yet scheduled (0 for an unknown sequence).
    fn unscheduled(&self, id: u64) -> usize {
        self.seqs
            .get(&id)
            .map_or(0, |s| s.tokens.len() - s.scheduled)
    }

    /// Copy-on-write pairs, copied as the engine would.
    fn copy(&mut self, pairs: &[(u32, u32)]) {
        for &(src, dst) in pairs {
            self.gpu[dst as usize] = self.gpu[src as usize].clone();
        }
    }

    /// After a successful extend of `id` by `k`: copy the pairs, check that only blocks at
    /// or past the first partly scheduled one moved, then write the new tokens' KV.
    fn scheduled_more(&mut self, id: u64, k: usize, pairs: &[(u32, u32)], write: bool) {
        let bs = self.bs();
        self.copy(pairs);
        let table = self.m.block_table(id).unwrap();
        let s = self.seqs.get_mut(&id).unwrap();
        let first = s.scheduled / bs;
        let mut moved = 0;
        for (i, (a, b)) in s.table.iter().zip(&table).enumerate() {
            if a != b {
                assert!(i >= first, "a scheduled full block of {id} changed");
                assert!(pairs.contains(&(*a, *b)), "block {a} -> {b} without a pair");
                moved += 1;
            }
        }
        assert_eq!(moved, pairs.len());
        let old = s.scheduled;
        s.scheduled += k;
        s.table = table;
        let written = s.written(bs);
        if write {
            self.write(id, old / bs..written);
        }
    }

    /// After a successful append of `each[i].1` to `each[i].0`: copy the pairs as the engine
    /// would, check that only written, shared blocks moved, then write the new tokens.
    fn appended(&mut self, each: &[(u64, Vec<u32>)], pairs: &[(u32, u32)]) {
        let bs = self.bs();
        self.copy(pairs);
        let mut moved = 0;
        for (id, tokens) in each {
            let table = self.m.block_table(*id).unwrap();
            let s = self.seqs.get_mut(id).unwrap();
            let first = s.tokens.len() / bs;
            for (i, (a, b)) in s.table.iter().zip(&table).enumerate() {
                if a != b {
                    assert!(i >= first, "an already written block of {id} changed");
                    assert!(
                        pairs.contains(&(*a, *b)),
                        "block {a} -> {b} of {id} without a pair"
                    );
                    moved += 1;
                }
            }
            let old = s.tokens.len();
            s.tokens.extend_from_slice(tokens);
            s.scheduled = s.tokens.len();
            s.table = table;
            let written = s.written(bs);
            self.write(*id, old / bs..written);
        }
        assert_eq!(
            moved,
            pairs.len(),
            "every copy-on-write pair replaces one table entry"
        );
    }

    fn check(&self, step: usize, op: &Op) {
        let bs = self.bs();
        if let Err(e) = self.m.check_invariants() {
            panic!("step {step} ({op:?}): {e}");
        }
        assert_eq!(self.m.num_sequences(), self.seqs.len());
        let mut used = std::collections::BTreeSet::new();
        for (&id, s) in &self.seqs {
            assert_eq!(self.m.num_tokens(id).unwrap(), s.tokens.len());
            assert_eq!(self.m.num_scheduled_tokens(id).unwrap(), s.scheduled);
            assert_eq!(self.m.is_swapped(id).unwrap(), s.cpu.is_some());
            let digests = if self.setup.caching {
                let extras = pagedkv_core::encode_extras(s.salt.then_some(&b"tenant"[..]), None);
                self.hasher.hash_chain(&s.tokens, bs, &extras)
            } else {
                vec![]
            };
            assert_eq!(self.m.block_hashes(id).unwrap(), digests, "sequence {id}");
            if let Some(cpu) = &s.cpu {
                for (i, &c) in cpu.iter().enumerate().take(s.written(bs)) {
                    assert!(
                        serves(self.cpu[c as usize].as_ref(), &s.content(i, bs)),
                        "CPU block {c}"
                    );
                }
                continue;
            }
            assert_eq!(
                self.m.block_table(id).unwrap(),
                s.table,
                "step {step} ({op:?})"
            );
            for (i, &b) in s.table.iter().enumerate().take(s.written(bs)) {
                assert!(
                    serves(self.gpu[b as usize].as_ref(), &s.content(i, bs)),
                    "step {step} ({op:?}): block {b} of sequence {id} holds other KV: {:?}",
                    self.gpu[b as usize]
                );
            }
            used.extend(s.table.iter().copied());
        }
        let st = self.m.stats();
        assert_eq!(
            st.free_blocks + st.used_blocks + st.cached_blocks,
            st.num_blocks
        );
        assert_eq!(
            st.used_blocks,
            used.len(),
            "used blocks are exactly those in tables"
        );
    }
}
