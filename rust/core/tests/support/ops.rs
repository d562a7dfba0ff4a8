//! Operation sequences over one `BlockManager`, checked step by step against a model of what
//! every GPU and CPU block holds. One interpreter for three drivers: the proptest
//! state-machine test (`tests/model.rs`), the cargo-fuzz target (`fuzz/fuzz_targets/ops.rs`)
//! and the replay of the fuzz corpus (`tests/fuzz_corpus.rs`).
//!
//! The model is the engine's view of KV memory: a block "holds" the prefix of the sequence that
//! last wrote it (salt and tokens up to the block's end). The manager decides block ids; the
//! model follows them as an engine would (prefill writes the computed blocks, copy-on-write and
//! swap pairs are copied, decode writes the last block) and checks, after every step, that each
//! live sequence's table points at blocks holding exactly its own prefix. So a wrong prefix hit
//! (including one through a digest collision), a block handed to two owners, a missed
//! copy-on-write or a lost swap shows up as a content mismatch, on top of `check_invariants`.
//! Every refused call (error or `None`) must leave the observable state unchanged.
//!
//! Encoding (what the fuzzer mutates): byte 0..4 choose the configuration, then every 4 bytes
//! are one operation `[opcode, a, b, c]`. Any byte string is a valid program.
#![allow(dead_code)]

use pagedkv_core::{BlockHasher, BlockManager, Config, Error, HashAlgo, Stats};
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
    },
    Append {
        seq: u64,
        count: u8,
        token: u8,
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
        match op % 16 {
            0..=2 => Op::Allocate {
                seq: id(a),
                prompt: x % 3,
                len: x / 3 % 24,
                tail: y % 9,
                salt: y & 0x80 != 0,
                lookahead: (y >> 4) % 4,
            },
            3..=5 => Op::Append {
                seq: id(a),
                count: 1 + x % 6,
                token: y,
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
    salt: bool,
    /// GPU table; empty while swapped.
    table: Vec<u32>,
    /// `Some(cpu blocks)` while swapped.
    cpu: Option<Vec<u32>>,
}

impl SeqModel {
    fn content(&self, i: usize, bs: usize) -> Content {
        let end = ((i + 1) * bs).min(self.tokens.len());
        (self.salt, self.tokens[..end].to_vec())
    }
    /// Blocks that hold tokens (lookahead blocks beyond them hold nothing yet).
    fn written(&self, bs: usize) -> usize {
        self.tokens.len().div_ceil(bs)
    }
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

type Snapshot = (Stats, Vec<(u64, usize, bool, Vec<u32>)>);

pub fn run(setup: &Setup, ops: &[Op]) -> Report {
    let mut config = Config::new(setup.num_blocks, setup.block_size);
    config.num_cpu_blocks = setup.num_cpu_blocks;
    config.enable_prefix_caching = setup.caching;
    config.hash_algo = setup.algo;
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
                let swapped = self.m.is_swapped(id).unwrap();
                let table = if swapped {
                    vec![]
                } else {
                    self.m.block_table(id).unwrap()
                };
                (id, n, swapped, table)
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
            } => {
                let tokens = self.prompt(prompt, len, tail);
                let salt_bytes = salt.then_some(&b"tenant"[..]);
                let out =
                    self.m
                        .allocate(seq, tokens.as_slice(), salt_bytes, None, lookahead.into());
                if self.seqs.contains_key(&seq) {
                    return self.expect_err(&before, out, &Error::DuplicateSequence(seq));
                }
                let Some(hit) = out.expect("allocate") else {
                    return self.refused(&before, "allocate", &None::<()>);
                };
                let n = tokens.len();
                assert!(hit % bs == 0 && (hit == 0 || hit < n), "hit {hit} of {n}");
                let table = self.m.block_table(seq).unwrap();
                assert_eq!(table.len(), (n + usize::from(lookahead)).div_ceil(bs));
                let model = SeqModel {
                    tokens,
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
                        "prefix hit on block {} serves another prompt's KV",
                        model.table[i]
                    );
                }
                let written = model.written(bs);
                self.seqs.insert(seq, model);
                self.write(seq, hit / bs..written);
                self.report.hit_tokens += hit;
            }
            Op::Append { seq, count, token } => {
                let tokens = vec![u32::from(token % 4); usize::from(count)];
                let out = self.m.append(seq, &tokens);
                if let Some(e) = self.fault(seq, true) {
                    return self.expect_err(&before, out, &e);
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
                if let Some(e) = ids.iter().find_map(|&i| self.fault(i, true)) {
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

    /// After a successful append of `each[i].1` to `each[i].0`: copy the pairs as the engine
    /// would, check that only written, shared blocks moved, then write the new tokens.
    fn appended(&mut self, each: &[(u64, Vec<u32>)], pairs: &[(u32, u32)]) {
        let bs = self.bs();
        for &(src, dst) in pairs {
            self.gpu[dst as usize] = self.gpu[src as usize].clone();
        }
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
                    assert_eq!(
                        self.cpu[c as usize],
                        Some(s.content(i, bs)),
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
                assert_eq!(
                    self.gpu[b as usize],
                    Some(s.content(i, bs)),
                    "step {step} ({op:?}): block {b} of sequence {id} holds other KV"
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
