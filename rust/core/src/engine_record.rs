//! An engine's request beside the sequence that holds its blocks: the counters an engine
//! adapter keeps per request (vLLM's `KVCacheManager` over this manager), and the decode
//! step that maps the engine's progress onto one `append` of the sequence.
//!
//! An engine that keeps its own progress counters (vLLM's scheduler: computed tokens, new
//! tokens, lookahead slots) asks for slots request by request. On a decode step the answer
//! is a pure function of those counters and the record: which known tokens to append, which
//! of the engine's block keys to hand over, how many lookahead slots to keep, how far the
//! tables grow. Planning it here, and running it as one call, keeps the per-request cost of
//! a step in Rust (the adapter's Python only forwards the call).

use crate::error::{invalid, Error, Result};
use crate::manager::BlockManager;
use crate::policy::GroupKind;
use crate::seq_map::{lock_cell, SeqCell};
use crate::sequence::Sequence;
use std::ops::Range;
use std::sync::Arc;

/// What the adapter holds for one request (all counts in tokens unless named otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineRecord {
    /// The sequence holding the request's blocks.
    pub seq: u64,
    /// Tokens the sequence knows.
    pub known: usize,
    /// Of them, scheduled for compute.
    pub scheduled: usize,
    /// Engine block keys handed over (one per block, from the first).
    pub keys: usize,
    /// Entries of each group's block table the engine has been given.
    pub table_len: usize,
    /// Registration held until the engine says the blocks are computed.
    pub held: bool,
}

/// The engine's side of one decode call.
#[derive(Clone, Copy, Debug)]
pub struct DecodeCall {
    /// Tokens the engine has computed (or has in flight) before this step.
    pub computed: usize,
    /// Tokens it schedules now (at least one).
    pub new_tokens: usize,
    /// Slots it wants past them (drafts, placeholders).
    pub lookahead: usize,
    /// Tokens the request knows (prompt and outputs).
    pub num_tokens: usize,
    /// Block keys the engine has for the request (at this manager's block size).
    pub num_keys: usize,
    /// The engine's longest sequence: no slot past it.
    pub max_len: usize,
    /// Tokens of steps still in flight (their KV is not written yet).
    pub in_flight: usize,
}

/// A decode step planned from the record and the call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// The request's tokens to append (positions in its token list).
    pub tokens: Range<usize>,
    /// The engine's keys to hand over (block positions).
    pub keys: Range<usize>,
    /// Slots past the known tokens.
    pub lookahead: usize,
    /// Known tokens after the step.
    pub end: usize,
    /// Where the groups that skip old entries release up to (None: nothing to release).
    pub release_at: Option<usize>,
}

impl DecodePlan {
    /// Hand over no key past the `num_keys` the engine has: a caller plans with
    /// `num_keys: usize::MAX` and reads the engine's keys only when the plan wants some
    /// (once a block, not every step).
    pub fn limit_keys(&mut self, num_keys: usize) {
        self.keys.end = self.keys.end.min(num_keys).max(self.keys.start);
    }

    /// Whether the step changes the sequence at all (a step with nothing new to schedule,
    /// no slot and no key leaves it as it is).
    fn appends(&self) -> bool {
        !self.tokens.is_empty() || self.lookahead > 0 || !self.keys.is_empty()
    }
}

/// What a decode step did besides giving the slots.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DecodeOut {
    /// Copy-on-write pairs the device must run.
    pub pairs: Vec<(u32, u32)>,
    /// The table entries the step added, `(first entry, per group the new block ids)`.
    pub grown: Option<(usize, Vec<Vec<u32>>)>,
    /// The first key handed over, when the step handed keys over.
    pub keys_from: Option<usize>,
}

impl EngineRecord {
    /// The decode step for `call`, or None when the call is not one: no new token, a
    /// registration held, known tokens not all scheduled (a prompt still in chunks), or a
    /// schedule that ends before the known tokens (a rollback). The caller then takes its
    /// general path. `releases`: whether some group drops entries a step no longer needs.
    pub fn plan_decode(
        &self,
        call: &DecodeCall,
        block_size: usize,
        caching: bool,
        releases: bool,
    ) -> Option<DecodePlan> {
        let target = call.computed.checked_add(call.new_tokens)?;
        if call.new_tokens == 0 || self.held || self.scheduled != self.known || target < self.known
        {
            return None;
        }
        let need = target.saturating_add(call.lookahead).min(call.max_len);
        let upto = target.min(call.num_tokens);
        let end = upto.max(self.known);
        let mut keys = self.keys..self.keys;
        if caching {
            let room = call.num_keys.min(end / block_size);
            if room > self.keys {
                keys.end = room;
            }
        }
        let release_at = releases.then(|| {
            call.computed
                .min(call.max_len)
                .saturating_sub(call.in_flight)
        });
        Some(DecodePlan {
            tokens: self.known..end,
            keys,
            lookahead: need.saturating_sub(end),
            end,
            release_at,
        })
    }
}

/// A sequence resolved once to its cell, so that a record's steps look nothing up in the
/// map of live sequences (as a running batch's members). Made by `BlockManager::seq_handle`.
pub struct SeqHandle {
    /// The manager whose cell this is (`BlockManager::instance`).
    pub(crate) owner: u64,
    pub(crate) id: u64,
    pub(crate) cell: Arc<SeqCell>,
}

impl BlockManager {
    /// Whether some group drops entries a step no longer needs (a window, a chunk, a state).
    pub fn releases_entries(&self) -> bool {
        self.kinds().iter().any(|k| *k != GroupKind::Full)
    }

    /// The handle of sequence `id` (live, or being created by a call still running).
    pub fn seq_handle(&self, id: u64) -> Result<SeqHandle> {
        let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
        Ok(SeqHandle {
            owner: self.instance,
            id,
            cell,
        })
    }

    /// `with_seq` (mutating) on a handle's sequence: the same gate, lock, liveness check and
    /// tallies, without the lookup. A sequence freed since is `UnknownSequence`, as by id.
    pub(crate) fn with_handle<T>(
        &self,
        h: &SeqHandle,
        f: impl FnOnce(&mut Sequence) -> Result<T>,
    ) -> Result<T> {
        if h.owner != self.instance {
            return Err(invalid("the sequence handle belongs to another manager"));
        }
        self.guarded(true, || {
            let _gate = self.enter()?;
            let mut seq = lock_cell(&h.cell)?;
            if !h.cell.is_live() {
                return Err(Error::UnknownSequence(h.id));
            }
            let before = seq.footprint(self.block_size());
            let out = f(&mut seq);
            self.account(before, seq.footprint(self.block_size()));
            out
        })
    }

    /// Run a planned decode step on `rec`'s sequence (`handle`): release what the skipping
    /// groups no longer need (even if the step is then refused, as vLLM frees them first),
    /// then, under one lock of the sequence, append `tokens` (the plan's) with `keys` (the
    /// plan's, or None) and the plan's lookahead and read the table entries it added; and
    /// bring the record up to date. `Ok(None)`: the blocks do not fit (the record and the
    /// tables are unchanged, the release aside). The record changes only on success, so a
    /// call retried after `WouldBlock` starts from the same record.
    pub fn decode_record(
        &self,
        rec: &mut EngineRecord,
        handle: &SeqHandle,
        plan: &DecodePlan,
        tokens: &[u32],
        keys: Option<&[Vec<u8>]>,
    ) -> Result<Option<DecodeOut>> {
        if handle.id != rec.seq {
            return Err(invalid(format!(
                "the handle is sequence {}'s, the record sequence {}'s",
                handle.id, rec.seq
            )));
        }
        if let Some(n) = plan.release_at {
            self.release_skipped(rec.seq, n)?;
        }
        let keys = keys.map(|k| self.reduce_keys(k)).transpose()?;
        let had = rec.table_len;
        let groups = self.kinds().len();
        let step = self.with_handle(handle, |seq| {
            let mut out = DecodeOut::default();
            let mut slots = plan.end;
            if plan.appends() {
                let appended =
                    self.append_one(rec.seq, seq, tokens, plan.lookahead, keys.as_ref(), false)?;
                match appended {
                    None => return Ok(None),
                    Some(pairs) => out.pairs = pairs,
                }
                slots += plan.lookahead;
            }
            let length = slots.div_ceil(self.block_size());
            if length > had {
                let ids = (0..groups)
                    .map(|g| seq.table(g).get(had..length).unwrap_or_default().to_vec())
                    .collect();
                out.grown = Some((had, ids));
            }
            Ok(Some((out, length)))
        })?;
        let Some((mut out, length)) = step else {
            return Ok(None);
        };
        rec.table_len = rec.table_len.max(length);
        if plan.appends() {
            rec.known = plan.end;
            rec.scheduled = plan.end;
            if !plan.keys.is_empty() {
                out.keys_from = Some(plan.keys.start);
                rec.keys = plan.keys.end;
            }
        }
        Ok(Some(out))
    }
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use crate::config::Config;

    /// An engine's decode call (block size 4: a key per 4 tokens).
    pub(crate) fn call(computed: usize, new_tokens: usize, num_tokens: usize) -> DecodeCall {
        DecodeCall {
            computed,
            new_tokens,
            lookahead: 0,
            num_tokens,
            num_keys: num_tokens / 4,
            max_len: 1 << 20,
            in_flight: 0,
        }
    }

    /// A record of sequence 1 with `known` tokens, all scheduled (block size 4).
    pub(crate) fn record(known: usize) -> EngineRecord {
        EngineRecord {
            seq: 1,
            known,
            scheduled: known,
            keys: known / 4,
            table_len: known.div_ceil(4),
            held: false,
        }
    }

    #[test]
    fn a_decode_step_appends_the_new_token_and_hands_over_a_full_blocks_key() {
        let rec = record(7);
        let plan = rec.plan_decode(&call(7, 1, 8), 4, true, false).unwrap();
        assert_eq!(plan.tokens, 7..8);
        assert_eq!(plan.keys, 1..2);
        assert_eq!((plan.end, plan.lookahead, plan.release_at), (8, 0, None));
    }

    #[test]
    fn calls_that_are_not_decode_steps_are_left_to_the_caller() {
        let rec = record(8);
        assert_eq!(rec.plan_decode(&call(8, 0, 8), 4, true, false), None);
        assert_eq!(rec.plan_decode(&call(3, 2, 8), 4, true, false), None);
        // Keys the engine does not have yet are not handed over.
        let mut plan = record(7)
            .plan_decode(&call(7, 1, 8), 4, true, false)
            .unwrap();
        plan.limit_keys(1);
        assert_eq!(plan.keys, 1..1);
        let held = EngineRecord { held: true, ..rec };
        assert_eq!(held.plan_decode(&call(8, 1, 9), 4, true, false), None);
        let chunked = EngineRecord {
            scheduled: 4,
            ..rec
        };
        assert_eq!(chunked.plan_decode(&call(8, 1, 9), 4, true, false), None);
    }

    #[test]
    fn lookahead_is_capped_at_the_longest_sequence_and_release_counts_in_flight() {
        let rec = record(8);
        let c = DecodeCall {
            lookahead: 5,
            max_len: 12,
            in_flight: 3,
            ..call(8, 1, 9)
        };
        let plan = rec.plan_decode(&c, 4, false, true).unwrap();
        assert_eq!((plan.end, plan.lookahead), (9, 3));
        assert_eq!(plan.keys, 2..2);
        assert_eq!(plan.release_at, Some(5));
    }

    #[test]
    fn decode_record_grows_the_table_and_updates_the_record_only_on_success() {
        let m = BlockManager::new(Config::new(3, 4)).unwrap();
        m.allocate(1, &[1, 2, 3, 4, 5, 6, 7], None, None, 0)
            .unwrap()
            .unwrap();
        let table = m.block_table(1).unwrap();
        let mut rec = record(7);
        rec.keys = 0;
        let plan = rec.plan_decode(&call(7, 1, 8), 4, false, false).unwrap();
        let h = m.seq_handle(1).unwrap();
        let out = m
            .decode_record(&mut rec, &h, &plan, &[8], None)
            .unwrap()
            .unwrap();
        assert_eq!(out.grown, None);
        assert_eq!((rec.known, rec.scheduled, rec.table_len), (8, 8, 2));
        let plan = rec.plan_decode(&call(8, 1, 9), 4, false, false).unwrap();
        let out = m
            .decode_record(&mut rec, &h, &plan, &[9], None)
            .unwrap()
            .unwrap();
        let added = m.block_table(1).unwrap()[2];
        assert_eq!(out.grown, Some((2, vec![vec![added]])));
        assert_eq!(m.block_table(1).unwrap()[..2], table[..]);
        assert_eq!((rec.known, rec.table_len), (9, 3));
        // The pool (3 blocks) is full: the next block does not fit, nothing changes.
        let before = rec;
        let c = DecodeCall {
            lookahead: 4,
            ..call(9, 1, 10)
        };
        let plan = rec.plan_decode(&c, 4, false, false).unwrap();
        assert_eq!(
            m.decode_record(&mut rec, &h, &plan, &[10], None).unwrap(),
            None
        );
        assert_eq!(rec, before);
        assert_eq!(m.num_tokens(1).unwrap(), 9);
        // A freed sequence's handle, or another manager's, is refused.
        let other = BlockManager::new(Config::new(3, 4)).unwrap();
        other.allocate(1, &[1], None, None, 0).unwrap().unwrap();
        let plan = rec.plan_decode(&call(9, 1, 10), 4, false, false).unwrap();
        let theirs = other.seq_handle(1).unwrap();
        assert!(m
            .decode_record(&mut rec, &theirs, &plan, &[10], None)
            .is_err());
        m.free(1).unwrap();
        assert!(matches!(
            m.decode_record(&mut rec, &h, &plan, &[10], None),
            Err(Error::UnknownSequence(1))
        ));
        assert_eq!(rec, before);
    }
}
