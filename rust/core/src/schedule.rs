//! Scheduling more tokens of a sequence: `append` (new tokens) and `extend` (more of the
//! known prompt, chunked prefill), with the helpers that write, hash and register blocks.

use crate::counters;
use crate::error::{invalid, Error, Result};
use crate::events::{KvEvent, Medium};
use crate::grouped::StepReq;
use crate::hashing::Digest;
use crate::keys::CallerKeys;
use crate::manager::{cdiv, check_append, check_extend, prefix_lock_of, BlockManager};
use crate::sequence::Sequence;

impl BlockManager {
    /// The number of leading blocks of `seq` that are full of scheduled tokens, digested
    /// (keyed) and below its hold: those that are (or were offered to be) registered.
    pub(crate) fn registrable(&self, seq: &Sequence) -> usize {
        (seq.scheduled / self.block_size())
            .min(seq.digests.len())
            .min(seq.hold_limit())
    }

    /// Whether `seq` must leave block `b` unregistered because it is caller-keyed and shares
    /// the (unregistered) block with its forks: they share the keys they had when forked,
    /// not those given later, so they could disagree on its digest, and every holder of a
    /// hashed block must release it under that block's digest. Only forks share an
    /// unregistered block, and under this sequence's lock none can fork it while `rc == 1`.
    pub(crate) fn shared_keyed(&self, seq: &Sequence, b: u32) -> bool {
        seq.keyed && self.gpu.state(b).load().rc() > 1
    }

    /// The event that stores full block `i` of `seq` on `medium` (group 0).
    pub(crate) fn stored_event(&self, seq: &Sequence, i: usize, medium: Medium) -> KvEvent {
        self.stored_event_of(seq, 0, i, medium)
    }

    /// Register the full blocks `range` of `seq` under their digests (`seq.digests[i]`), and
    /// count those that were new with one update of the shared counter. Returns that count.
    pub(crate) fn register_range(&self, seq: &Sequence, range: std::ops::Range<usize>) -> usize {
        let mut new = 0;
        for i in range {
            if self.shared_keyed(seq, seq.blocks[i]) {
                continue;
            }
            let event = || self.stored_event(seq, i, Medium::Gpu);
            self.gpu.set_tenant(seq.blocks[i], seq.tenant());
            new += usize::from(
                self.gpu
                    .register(seq.blocks[i], seq.digests[i], seq.tag(i), event),
            );
        }
        if new > 0 {
            counters::add(&self.counters.registered_blocks, new);
            if let Some(t) = self.gpu.tally(0) {
                counters::add(&t.registered, new);
            }
        }
        new
    }

    /// Release a table's blocks, tail first.
    pub(crate) fn release_blocks(&self, blocks: &[u32], digests: &[Digest]) -> Result<()> {
        self.gpu.release_table(blocks, digests)
    }

    /// Whether a write into table entry `b` must copy it first: another table holds it
    /// (copy-on-write), or it is hashed. A block a write reaches is never hashed while the
    /// invariants hold (`truncate` leaves its partial block exclusive and unhashed, and only
    /// blocks full of scheduled tokens are registered); copying a hashed one anyway is the
    /// defence that keeps a broken state from serving this sequence's KV under its digest.
    pub(crate) fn must_copy(&self, b: u32) -> bool {
        let w = self.gpu.state(b).load();
        w.rc() > 1 || w.hashed()
    }

    /// Drop this table's reference to `src`, the source of a copy: under the digest it is
    /// registered under while hashed (it may become CACHED), else under `digest`, the
    /// table's own digest of that entry (another holder may register it meanwhile, under
    /// the same chain digest: forks share their tokens).
    pub(crate) fn release_copied(&self, src: u32, digest: Option<&Digest>) -> Result<()> {
        if self.gpu.state(src).load().hashed() {
            let len = self.hasher.root().as_bytes().len();
            let stored = Digest::from_words(self.gpu.index_digest_words(src), len);
            return self.gpu.release(src, Some(&stored));
        }
        self.gpu.release(src, digest)
    }

    /// Blocks that writing positions `from .. to` of `seq` needs: copy-on-write copies of
    /// the shared (or hashed: `must_copy`) table entries it covers plus new blocks past the
    /// table.
    pub(crate) fn write_need(&self, seq: &Sequence, from: usize, to: usize) -> usize {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let shared = (from / bs..end.min(seq.blocks.len()))
            .filter(|&i| self.must_copy(seq.blocks[i]))
            .count();
        shared + end.saturating_sub(seq.blocks.len())
    }

    /// Blocks that appending `k` tokens and reserving `lookahead` slots past them needs.
    pub(crate) fn append_need(&self, seq: &Sequence, k: usize, lookahead: usize) -> usize {
        let n = seq.tokens.len();
        self.write_need(seq, n, (n + k).saturating_add(lookahead))
    }

    /// Room for `k` more tokens in `seq`, reserved before an append changes anything, so that
    /// running out of memory is an error that changed nothing.
    pub(crate) fn reserve_tokens(&self, seq: &mut Sequence, k: usize) -> Result<()> {
        crate::alloc::try_grow(&mut seq.tokens, k, "a sequence's tokens")
    }

    /// Make positions `from .. to` of `seq` writable with the `write_need` units the caller
    /// reserved in `spare`: copy the shared table entries (pairs to `pairs`), add blocks.
    /// Unused units stay in `spare`.
    pub(crate) fn write_reserved(
        &self,
        seq: &mut Sequence,
        from: usize,
        to: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        for i in from / bs..end.min(seq.blocks.len()) {
            let src = seq.blocks[i];
            // Another holder may have dropped its reference since `write_need` (refcounts of
            // a locked sequence's unhashed blocks only fall): then the block is ours to write.
            if self.must_copy(src) {
                *spare = spare
                    .checked_sub(1)
                    .ok_or_else(|| Error::Broken("copy-on-write beyond its reservation".into()))?;
                let dst = self.gpu.take();
                pairs.push((src, dst));
                seq.replace_block(i, dst);
                self.release_copied(src, seq.digests.get(i))?;
                counters::add(&self.counters.cow_copies, 1);
            }
        }
        while seq.blocks.len() < end {
            *spare = spare
                .checked_sub(1)
                .ok_or_else(|| Error::Broken("a write beyond its reservation".into()))?;
            seq.push_block(self.gpu.take());
        }
        Ok(())
    }

    /// Append `tokens` (and make `lookahead` slots past them writable) to a sequence whose
    /// `append_need` units the caller reserved in `spare`, and whose token room
    /// `reserve_tokens` reserved; copy-on-write pairs go to `pairs`. Unused units stay in
    /// `spare`.
    /// `keys`: a caller-keyed sequence's further keys, checked (`check_more_keys`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn append_reserved(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        keys: Option<&CallerKeys>,
        lookahead: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let n = seq.tokens.len();
        let m = n + tokens.len();
        self.write_reserved(seq, n, m.saturating_add(lookahead), spare, pairs)?;
        // The caller reserved the room (`reserve_tokens`): this cannot fail half way.
        seq.tokens.extend_from_slice(tokens);
        self.extend_digests(seq);
        self.schedule_keyed(seq, m, keys);
        Ok(())
    }

    /// Compute the digests (and tags) of blocks that became full of known tokens.
    /// A caller-keyed sequence's digests come only from its keys: nothing to hash.
    pub(crate) fn extend_digests(&self, seq: &mut Sequence) {
        if !self.caching() || seq.keyed {
            return;
        }
        let bs = self.block_size();
        for i in seq.digests.len()..seq.tokens.len() / bs {
            let parent = i
                .checked_sub(1)
                .map_or_else(|| self.hasher.root(), |p| seq.digests[p]);
            let d = self
                .hasher
                .hash_block(&parent, &seq.tokens[i * bs..(i + 1) * bs], &seq.extras);
            seq.digests.push(d);
            if let Some(t) = &self.tagger {
                let parent = i.checked_sub(1).map_or_else(|| t.root(), |p| seq.tags[p]);
                let tag = t.tag_block(parent, &seq.tokens[i * bs..(i + 1) * bs], &seq.extras);
                seq.tags.push(tag);
            }
        }
    }

    /// Mark the first `upto` tokens scheduled and register the blocks that became full of
    /// scheduled tokens.
    pub(crate) fn schedule_to(&self, seq: &mut Sequence, upto: usize) {
        self.schedule_keyed(seq, upto, None);
    }

    /// `schedule_to` that first adds a caller-keyed sequence's further `keys` (checked): the
    /// blocks they key below the scheduled tokens register too.
    pub(crate) fn schedule_keyed(
        &self,
        seq: &mut Sequence,
        upto: usize,
        keys: Option<&CallerKeys>,
    ) {
        let before = self.registrable(seq);
        Self::add_keys(seq, keys);
        seq.scheduled = upto;
        self.register_range(seq, before..self.registrable(seq));
    }

    /// The prefix lock that scheduling `seq` up to `upto` tokens, `new` of them appended now
    /// and `keys` added, needs: `Some` when caching is on and a block becomes registrable
    /// (full of scheduled tokens, digested, below the hold; it is then registered). Computed
    /// before any change, so that waiting for it can still back out.
    pub(crate) fn schedule_prefix_key(
        &self,
        seq: &Sequence,
        upto: usize,
        new: &[u32],
        keys: Option<&CallerKeys>,
    ) -> Option<usize> {
        let bs = self.block_size();
        let after = (upto / bs)
            .min(self.digests_after(seq, new.len(), keys))
            .min(seq.hold_limit());
        if after <= self.registrable(seq) {
            return None;
        }
        if let Some(first) = seq.digests.first() {
            return Some(prefix_lock_of(first));
        }
        if let Some(first) = keys.and_then(|k| k.digests.first()) {
            return Some(prefix_lock_of(first));
        }
        // A self-hashed sequence's first block, full only with the new tokens.
        let have = seq.tokens.len().min(bs);
        let mut block = seq.tokens[..have].to_vec();
        block.extend_from_slice(&new[..bs - have]);
        let first = self
            .hasher
            .hash_block(&self.hasher.root(), &block, &seq.extras);
        Some(prefix_lock_of(&first))
    }

    /// Add generated tokens. Returns the copy-on-write pairs, or `None` when the blocks do
    /// not fit (nothing changed).
    pub fn append(&self, id: u64, tokens: &[u32]) -> Result<Option<Vec<(u32, u32)>>> {
        self.append_lookahead(id, tokens, 0)
    }

    /// `append` that also makes `lookahead` slots past the new tokens writable (draft tokens
    /// of speculative decoding).
    pub fn append_lookahead(
        &self,
        id: u64,
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        self.append_with(id, tokens, lookahead, None)
    }

    /// `append_lookahead` that also continues a caller-keyed sequence's keys with
    /// `block_hashes` (registering what they make registrable). `tokens` may be empty with
    /// `lookahead > 0` (slots only) or with keys (keys only).
    pub fn append_with(
        &self,
        id: u64,
        tokens: &[u32],
        lookahead: usize,
        block_hashes: Option<&[Vec<u8>]>,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        self.append_releasing(id, tokens, lookahead, block_hashes, true)
    }

    /// `append_with`; `release: false` leaves the entries the groups no longer need in
    /// place (the caller releases them with `release_skipped`).
    pub fn append_releasing(
        &self,
        id: u64,
        tokens: &[u32],
        lookahead: usize,
        block_hashes: Option<&[Vec<u8>]>,
        release: bool,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        if tokens.is_empty() && lookahead == 0 && block_hashes.is_none() {
            return Err(invalid(
                "token_ids must not be empty (unless lookahead > 0 or block_hashes are given)",
            ));
        }
        self.guarded(true, || {
            let keys = block_hashes.map(|k| self.reduce_keys(k)).transpose()?;
            self.with_seq(id, true, |seq| {
                self.append_one(id, seq, tokens, lookahead, keys.as_ref(), release)
            })
        })
    }

    /// `append_with` on the locked sequence `id`, its keys reduced.
    pub(crate) fn append_one(
        &self,
        id: u64,
        seq: &mut Sequence,
        tokens: &[u32],
        lookahead: usize,
        keys: Option<&CallerKeys>,
        release: bool,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        if seq.is_swapped() {
            return Err(Error::Swapped(id));
        }
        check_append(id, seq.tokens.len(), seq.scheduled, tokens.len())?;
        let upto = seq.tokens.len() + tokens.len();
        if let Some(k) = keys {
            self.check_more_keys(id, seq, k, upto)?;
        }
        if !self.plain() {
            let req = StepReq {
                new: tokens,
                keys,
                m: upto,
                to: upto.saturating_add(lookahead),
                release,
            };
            return self.step_grouped(&mut [seq], &[req], None, false);
        }
        self.reserve_tokens(seq, tokens.len())?;
        let locks = self
            .schedule_prefix_key(seq, upto, tokens, keys)
            .into_iter()
            .collect();
        let _prefix = self.lock_prefixes(locks)?;
        let need = self.append_need(seq, tokens.len(), lookahead);
        if !self.gpu.reserve(need) {
            return Ok(None);
        }
        let mut spare = need;
        let mut pairs = Vec::new();
        self.append_reserved(seq, tokens, keys, lookahead, &mut spare, &mut pairs)?;
        self.gpu.unreserve(spare);
        Ok(Some(pairs))
    }

    /// Schedule the next `k` tokens of the known prompt (chunked prefill), making `lookahead`
    /// slots past them writable. Returns the copy-on-write pairs, or `None` when the blocks
    /// do not fit (nothing changed).
    pub fn extend(&self, id: u64, k: usize, lookahead: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.extend_releasing(id, k, lookahead, true)
    }

    /// `extend`; `release: false` leaves the entries the groups no longer need in place
    /// (the caller releases them with `release_skipped`).
    pub fn extend_releasing(
        &self,
        id: u64,
        k: usize,
        lookahead: usize,
        release: bool,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            check_extend(id, seq.tokens.len(), seq.scheduled, k)?;
            let from = seq.scheduled;
            let upto = from + k;
            if !self.plain() {
                let req = StepReq {
                    new: &[],
                    keys: None,
                    m: upto,
                    to: upto.saturating_add(lookahead),
                    release,
                };
                return self.step_grouped(&mut [seq], &[req], None, false);
            }
            let keys = self
                .schedule_prefix_key(seq, upto, &[], None)
                .into_iter()
                .collect();
            let _prefix = self.lock_prefixes(keys)?;
            let to = upto.saturating_add(lookahead);
            let need = self.write_need(seq, from, to);
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            self.write_reserved(seq, from, to, &mut spare, &mut pairs)?;
            self.schedule_to(seq, upto);
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        })
    }
}
