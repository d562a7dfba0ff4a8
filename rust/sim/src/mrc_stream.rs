//! The miss-ratio curve recorder's stream (`python/pagedkv/sim/mrc.py` is the reference and
//! explains the model): the scheduler's calls become, in order, *lookups* (a prompt's full
//! blocks when it is first admitted) and *touches* (blocks registered as their tokens are
//! scheduled, pinned by a hit, or released tail first), over block content keys. `curve`
//! then turns the stream into the sorted thresholds of `stack::thresholds`.
//!
//! Sampling (SHARDS): only keys whose top `SAMPLE_BITS` bits fall below `threshold` enter the
//! stream. A lookup is kept even when sampling empties it (it still counts its prompt).

use crate::block_keys::{chain, content, step};
use crate::stack::{thresholds, Thresholds};
use crate::stream::{with_parents, Stream, NO_PARENT};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Top bits of a key that decide whether it is sampled.
pub const SAMPLE_BITS: u32 = 24;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StreamError {
    #[error("unknown sequence {0}")]
    UnknownSeq(u64),
    #[error("block_size must be in [1, 65536], got {0}")]
    BlockSize(usize),
    #[error("sample threshold must be in [1, 2**24], got {0}")]
    Threshold(u64),
}

/// Maps keyed by sequence ids or block keys, both plain integers: a multiply spreads them.
#[derive(Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;
type IntSet<K> = HashSet<K, BuildHasherDefault<IntHasher>>;

/// What the stream knows of a live sequence.
#[derive(Clone, Debug)]
struct Seq {
    /// Keys of its full blocks in token order: the prompt's first, then appended ones.
    keys: Vec<u64>,
    /// Full blocks of the tokens it was allocated with (the first `prompt_blocks` keys).
    prompt_blocks: usize,
    prompt_len: usize,
    /// Tokens scheduled so far.
    scheduled: usize,
    /// Chain state after the last full block.
    state: u64,
    /// Tokens past the last full block.
    partial: Vec<u32>,
    /// The allocated tokens' partial last block (becomes `partial` once all are scheduled).
    tail: Vec<u32>,
    swapped: bool,
}

impl Seq {
    /// Keys of the blocks it has registered: the scheduled part of the prompt, or all.
    fn registered(&self, block_size: usize) -> &[u64] {
        if self.scheduled < self.prompt_len {
            &self.keys[..self.scheduled / block_size]
        } else {
            &self.keys
        }
    }
}

pub struct MrcStream {
    block_size: usize,
    /// Keys whose top `SAMPLE_BITS` bits are below this are recorded (`2^24`: all).
    threshold: u64,
    /// The lookups and touches so far (sampled keys only), with each key's parent.
    stream: Stream,
    seqs: IntMap<u64, Seq>,
    /// Sequences allocated or forked so far: allocating one again recomputes, no lookup.
    admitted: IntSet<u64>,
    pub prompt_tokens: u64,
    pub lookups: u64,
}

impl MrcStream {
    pub fn new(block_size: usize, threshold: u64) -> Result<Self, StreamError> {
        if !(1..=1 << 16).contains(&block_size) {
            return Err(StreamError::BlockSize(block_size));
        }
        if !(1..=1 << SAMPLE_BITS).contains(&threshold) {
            return Err(StreamError::Threshold(threshold));
        }
        Ok(Self {
            block_size,
            threshold,
            stream: Stream::default(),
            seqs: IntMap::default(),
            admitted: IntSet::default(),
            prompt_tokens: 0,
            lookups: 0,
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Append the sampled part of `new` (`(key, parent)` pairs) as a piece (a touch only if
    /// anything is left).
    fn push(
        stream: &mut Stream,
        threshold: u64,
        new: impl IntoIterator<Item = (u64, u64)>,
        lookup: bool,
    ) {
        let shift = 64 - SAMPLE_BITS;
        stream.push(
            new.into_iter().filter(|(k, _)| k >> shift < threshold),
            lookup,
        );
    }

    fn seq(&mut self, seq_id: u64) -> Result<&mut Seq, StreamError> {
        self.seqs
            .get_mut(&seq_id)
            .ok_or(StreamError::UnknownSeq(seq_id))
    }

    /// A sequence was allocated `tokens` under chain root `root` (salt and LoRA id), the
    /// first `scheduled` of them scheduled.
    pub fn allocate(&mut self, seq_id: u64, tokens: &[u32], scheduled: usize, root: u64) {
        let bs = self.block_size;
        let n = tokens.len();
        let mut keys = Vec::new();
        let state = chain(root, tokens, bs, &mut keys);
        let nb = keys.len();
        if self.admitted.insert(seq_id) {
            self.prompt_tokens += n as u64;
            self.lookups += 1;
            let upto = n.saturating_sub(1) / bs;
            Self::push(
                &mut self.stream,
                self.threshold,
                with_parents(&keys, 0..upto),
                true,
            );
        }
        let seq = Seq {
            keys,
            prompt_blocks: nb,
            prompt_len: n,
            scheduled: 0,
            state,
            partial: Vec::new(),
            tail: tokens[nb * bs..].to_vec(),
            swapped: false,
        };
        self.seqs.insert(seq_id, seq);
        self.schedule(seq_id, scheduled);
    }

    /// Prompt tokens up to `upto` are scheduled: their full blocks are registered.
    fn schedule(&mut self, seq_id: u64, upto: usize) {
        let bs = self.block_size;
        let Some(seq) = self.seqs.get_mut(&seq_id) else {
            return;
        };
        let first = seq.scheduled / bs;
        let last = (upto / bs).min(seq.prompt_blocks);
        seq.scheduled = upto;
        if upto >= seq.prompt_len {
            seq.partial = seq.tail.clone();
        }
        if last > first {
            let new = with_parents(&seq.keys, first..last);
            Self::push(&mut self.stream, self.threshold, new, false);
        }
    }

    /// The next `n` prompt tokens were scheduled.
    pub fn extend(&mut self, seq_id: u64, n: usize) -> Result<(), StreamError> {
        let upto = self.seq(seq_id)?.scheduled + n;
        self.schedule(seq_id, upto);
        Ok(())
    }

    /// Tokens were appended (decoded, or accepted drafts): the blocks they fill are touched.
    pub fn append(&mut self, seq_id: u64, tokens: &[u32]) -> Result<(), StreamError> {
        let bs = self.block_size;
        let seq = self
            .seqs
            .get_mut(&seq_id)
            .ok_or(StreamError::UnknownSeq(seq_id))?;
        seq.partial.extend_from_slice(tokens);
        if seq.partial.len() < bs {
            return Ok(());
        }
        let full = seq.partial.len() / bs * bs;
        let start = seq.keys.len();
        seq.state = chain(seq.state, &seq.partial[..full], bs, &mut seq.keys);
        seq.partial.drain(..full);
        let end = seq.keys.len();
        Self::push(
            &mut self.stream,
            self.threshold,
            with_parents(&seq.keys, start..end),
            false,
        );
        Ok(())
    }

    /// One decode step: `tokens[i]` appended to `seq_ids[i]`. The blocks it fills form one
    /// touch, in the batch's order. All or nothing: an unknown id changes nothing.
    pub fn decode(&mut self, seq_ids: &[u64], tokens: &[u32]) -> Result<(), StreamError> {
        assert_eq!(seq_ids.len(), tokens.len(), "one token per sequence");
        if let Some(&bad) = seq_ids.iter().find(|id| !self.seqs.contains_key(id)) {
            return Err(StreamError::UnknownSeq(bad));
        }
        let bs = self.block_size;
        let shift = 64 - SAMPLE_BITS;
        let mut filled = Vec::new();
        for (id, &tok) in seq_ids.iter().zip(tokens) {
            let seq = self.seqs.get_mut(id).expect("checked above");
            seq.partial.push(tok);
            if seq.partial.len() == bs {
                let (key, raw) = step(seq.state, content(&seq.partial));
                let parent = seq.keys.last().copied().unwrap_or(NO_PARENT);
                seq.state = raw;
                seq.keys.push(key);
                seq.partial.clear();
                if key >> shift < self.threshold {
                    filled.push((key, parent));
                }
            }
        }
        self.stream.push(filled, false);
        Ok(())
    }

    /// `child_id` now shares every block of `parent_id` (and is admitted: no lookup later).
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> Result<(), StreamError> {
        let copy = self.seq(parent_id)?.clone();
        self.seqs.insert(child_id, copy);
        self.admitted.insert(child_id);
        Ok(())
    }

    /// Released blocks are touched tail first, so that the head ends the most recent.
    fn release(&mut self, seq: &Seq) {
        let n = seq.registered(self.block_size).len();
        let new = with_parents(&seq.keys, 0..n).rev();
        Self::push(&mut self.stream, self.threshold, new, false);
    }

    pub fn free(&mut self, seq_id: u64) -> Result<(), StreamError> {
        let seq = self
            .seqs
            .remove(&seq_id)
            .ok_or(StreamError::UnknownSeq(seq_id))?;
        if !seq.swapped {
            self.release(&seq);
        }
        Ok(())
    }

    pub fn swap_out(&mut self, seq_id: u64) -> Result<(), StreamError> {
        let seq = self.seq(seq_id)?.clone();
        self.release(&seq);
        self.seq(seq_id)?.swapped = true;
        Ok(())
    }

    pub fn swap_in(&mut self, seq_id: u64) -> Result<(), StreamError> {
        let bs = self.block_size;
        let seq = self
            .seqs
            .get(&seq_id)
            .ok_or(StreamError::UnknownSeq(seq_id))?;
        let n = seq.registered(bs).len();
        Self::push(
            &mut self.stream,
            self.threshold,
            with_parents(&seq.keys, 0..n),
            false,
        );
        self.seq(seq_id)?.swapped = false;
        Ok(())
    }

    /// Keys recorded so far (lookups and touches).
    pub fn len(&self) -> usize {
        self.stream.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stream.keys.is_empty()
    }

    /// The lookups and touches recorded so far (sampled keys only).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The curve's thresholds over the stream so far, distances scaled by `1 / rate`.
    pub fn curve(&self, rate: f64) -> Thresholds {
        thresholds(&self.stream.keys, &self.stream.pieces, rate, 0)
    }
}
