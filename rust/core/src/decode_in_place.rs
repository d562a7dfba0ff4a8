//! A decode step that writes its one token into a slot the sequence already holds.
//!
//! Most decode steps of a running request add one known token inside the last block of
//! its table: no new block, no copy, no key to hand over, nothing to release. Such a step's
//! answer to the engine does not depend on the step running first (the slot is there), so
//! an engine adapter may answer it at once and apply it to the sequence later, in a batch
//! with the step's other such requests (pagedkv.vllm's deferred decodes). This module
//! decides, ahead of the step, whether a planned step is one of them.

use crate::alloc::try_with_capacity;
use crate::batch::lock_all;
use crate::engine_record::{DecodePlan, EngineRecord, SeqHandle};
use crate::error::{invalid, Error, Result};
use crate::manager::BlockManager;
use crate::seq_map::{lock_cell, SeqCell};

impl DecodePlan {
    /// Whether the plan appends exactly one known token and nothing else (no key, no
    /// lookahead slot, no release) into the table entries the engine already has
    /// (`table_len` entries of `block_size` slots): then the step adds no entry.
    pub fn is_one_token(&self, table_len: usize, block_size: usize) -> bool {
        self.keys.is_empty() && self.is_one_token_keyed(table_len, block_size)
    }

    /// `is_one_token`, or the step whose token fills its block and hands over that block's
    /// key (and no other): still no new entry, no copy, no release.
    pub fn is_one_token_keyed(&self, table_len: usize, block_size: usize) -> bool {
        self.tokens.len() == 1
            && (self.keys.is_empty()
                || (self.keys.len() == 1 && self.keys.end.saturating_mul(block_size) == self.end))
            && self.lookahead == 0
            && self.release_at.is_none()
            && self.end <= table_len.saturating_mul(block_size)
    }
}

impl BlockManager {
    /// Whether `plan`, a one-token step of `rec` (`DecodePlan::is_one_token_keyed`: with the
    /// key of the block it fills, if any, continuing the sequence's keys), writes into a
    /// slot `rec`'s sequence already holds: a manager of one full-attention group without a
    /// null block, the sequence live and resident, knowing `rec.known` tokens, all of them
    /// scheduled, and the slot's block its own (no copy and no new block needed). Then
    /// `decode_record` of the plan adds nothing to the table, copies nothing and cannot run
    /// out of blocks, until the sequence changes or is forked (a fork shares the block).
    /// Reads only; false, not an error, for a sequence that is gone.
    pub fn decode_in_place(
        &self,
        rec: &EngineRecord,
        handle: &SeqHandle,
        plan: &DecodePlan,
    ) -> Result<bool> {
        if !self.plain() || !plan.is_one_token_keyed(rec.table_len, self.block_size()) {
            return Ok(false);
        }
        if handle.owner != self.instance || handle.id != rec.seq {
            return Err(invalid("the sequence handle is another sequence's"));
        }
        let seq = lock_cell(&handle.cell)?;
        if !handle.cell.is_live() || seq.is_swapped() {
            return Ok(false);
        }
        let known = seq.tokens.len();
        // A key continues a caller-keyed sequence's keys, with caching on (else the step
        // takes the general path, which says what is wrong).
        let key_fits = plan.keys.is_empty()
            || (self.caching() && seq.keyed && seq.digests.len() == plan.keys.start);
        Ok(known == rec.known
            && seq.scheduled == known
            && plan.tokens.start == known
            && key_fits
            && self.append_need(&seq, 1, 0) == 0)
    }
}

impl BlockManager {
    /// How far a run of one-token steps that starts with `plan` (one `decode_in_place`
    /// approved, handing over no key) goes on writing in place: the end (exclusive) of the
    /// positions in the block of its token that the engine's table holds, short of the
    /// position that fills the block when caching is on (that step hands over the block's
    /// key: it is planned by itself). Each later step writes the next slot of the same
    /// block, which stays the sequence's own while nothing but the run's steps changes the
    /// sequence (a fork or any other change ends the run first: the adapter settles before
    /// every other call). At least one past the plan's token.
    pub fn in_place_end(&self, rec: &EngineRecord, plan: &DecodePlan) -> usize {
        let bs = self.block_size();
        let start = plan.tokens.start;
        let block_end = (start / bs).saturating_add(1).saturating_mul(bs);
        let mut end = block_end.min(rec.table_len.saturating_mul(bs));
        if self.caching() {
            end = end.min(block_end - 1);
        }
        end.max(start.saturating_add(1))
    }
}

impl BlockManager {
    /// Apply a run of planned one-token steps (`in_place_end`) at once: `tokens` appended to
    /// `rec`'s sequence (`handle`), which must know exactly `rec.known` tokens, all
    /// scheduled; they must write into slots the sequence holds, filling no block whose key
    /// caching would want (that step is planned by itself, with its key). Under one lock of
    /// the sequence; an error, changing nothing, where any of that does not hold. Then the
    /// record follows the sequence.
    pub fn append_run(
        &self,
        rec: &mut EngineRecord,
        handle: &SeqHandle,
        tokens: &[u32],
    ) -> Result<()> {
        if !self.plain() {
            return Err(invalid("planned steps are for one full-attention group"));
        }
        if handle.id != rec.seq {
            return Err(invalid("the sequence handle is another sequence's"));
        }
        let bs = self.block_size();
        let id = rec.seq;
        let known = rec.known;
        let not_planned = |what: &str| {
            Err(Error::Invariant(format!(
                "sequence {id}: planned steps {known}..{}: {what}",
                known + tokens.len()
            )))
        };
        self.with_handle(handle, |seq| {
            let n = seq.tokens.len();
            if n != known || seq.scheduled != n {
                return not_planned("the sequence is not where they start");
            }
            if self.caching() && (n + tokens.len()) / bs != n / bs {
                return not_planned("they fill a block without its key");
            }
            if self.append_need(seq, tokens.len(), 0) != 0 {
                return not_planned("they do not write in place");
            }
            match self.append_one(id, seq, tokens, 0, None, false)? {
                Some(pairs) if pairs.is_empty() => Ok(()),
                _ => not_planned("they needed blocks"),
            }
        })?;
        rec.known += tokens.len();
        rec.scheduled = rec.known;
        Ok(())
    }
}

impl BlockManager {
    /// Apply planned one-token steps together: `tokens[i]` appended to the sequence of
    /// `handles[i]`, which must know exactly `known[i]` tokens, all scheduled, and `keys[i]`
    /// (when given) added as the key of the block the token fills; distinct sequences, all
    /// or nothing, as `append_batch` (its prefetching and one lock of each cell). A plain
    /// manager only (one full-attention group, no null block). Returns the copy-on-write
    /// pairs, or None when the blocks do not fit (nothing changed): planned steps
    /// (`decode_in_place`) give `Some(vec![])`.
    pub fn append_planned(
        &self,
        handles: &[&SeqHandle],
        known: &[usize],
        tokens: &[u32],
        keys: &[Option<Vec<u8>>],
    ) -> Result<Option<Vec<(u32, u32)>>> {
        if handles.len() != tokens.len()
            || known.len() != tokens.len()
            || keys.len() != tokens.len()
        {
            return Err(invalid(format!(
                "{} handles, {} token counts, {} tokens and {} keys",
                handles.len(),
                known.len(),
                tokens.len(),
                keys.len()
            )));
        }
        // The keys' digests, computed before any lock is taken.
        let mut caller_keys = try_with_capacity(keys.len(), "the planned steps' keys")?;
        for key in keys {
            caller_keys.push(match key {
                Some(k) => Some(self.reduce_keys(std::slice::from_ref(k))?),
                None => None,
            });
        }
        if !self.plain() {
            return Err(invalid("planned steps are for one full-attention group"));
        }
        if handles.iter().any(|h| h.owner != self.instance) {
            return Err(invalid("a sequence handle belongs to another manager"));
        }
        self.guarded(true, || {
            let _gate = self.enter()?;
            let mut ids = try_with_capacity(handles.len(), "the planned steps' ids")?;
            ids.extend(handles.iter().map(|h| h.id));
            let mut cells: Vec<Option<&SeqCell>> =
                try_with_capacity(handles.len(), "the planned steps' cells")?;
            cells.extend(handles.iter().map(|h| Some(&*h.cell)));
            let mut locked = lock_all(&ids, &cells, true)?;
            // Every sequence where its plan left it, before anything changes.
            for (i, &id) in ids.iter().enumerate() {
                let live = locked.cells[locked.at[i]].is_some_and(|c| c.is_live());
                match locked.guards[locked.at[i]].as_deref() {
                    Some(seq) if live && seq.tokens.len() == known[i] => {}
                    Some(_) if live => {
                        return Err(Error::Invariant(format!(
                            "sequence {id} is not where its planned step starts"
                        )))
                    }
                    _ => return Err(Error::UnknownSequence(id)),
                }
            }
            self.append_one_each(&ids, tokens, &mut locked, None, Some(&caller_keys))
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::config::Config;
    use crate::engine_record::tests as records;
    use crate::engine_record::{DecodeCall, DecodeOut, EngineRecord};
    use crate::manager::BlockManager;

    /// vLLM's decode call of one token (keys planned without reading them).
    fn call(computed: usize) -> DecodeCall {
        DecodeCall {
            num_keys: usize::MAX,
            ..records::call(computed, 1, computed + 1)
        }
    }

    /// A record with no key handed over.
    fn record(known: usize) -> EngineRecord {
        EngineRecord {
            keys: 0,
            ..records::record(known)
        }
    }

    #[test]
    fn in_place_until_the_block_fills_and_then_the_step_applies_as_planned() {
        let m = BlockManager::new(Config::new(8, 4)).unwrap();
        m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
            .unwrap()
            .unwrap();
        let h = m.seq_handle(1).unwrap();
        let mut rec = record(5);
        // Tokens 6 and 7 go into block 1's free slots; token 8 fills it (in place too, no
        // caching: no key is due); token 9 needs a new block.
        for (token, in_place) in [(6, true), (7, true), (8, true), (9, false)] {
            let plan = rec.plan_decode(&call(rec.known), 4, false, false).unwrap();
            assert_eq!(m.decode_in_place(&rec, &h, &plan).unwrap(), in_place);
            let out = m
                .decode_record(&mut rec, &h, &plan, &[token], None)
                .unwrap()
                .unwrap();
            assert_eq!(out == DecodeOut::default(), in_place, "token {token}");
            if !in_place {
                rec.table_len = 3;
            }
        }
        assert_eq!(m.num_tokens(1).unwrap(), 9);
    }

    #[test]
    fn a_run_ends_at_its_blocks_end_or_short_of_the_step_that_hands_over_its_key() {
        for caching in [false, true] {
            let mut cfg = Config::new(8, 4);
            cfg.enable_prefix_caching = caching;
            let m = BlockManager::new(cfg).unwrap();
            m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
                .unwrap()
                .unwrap();
            let rec = record(5);
            let plan = rec.plan_decode(&call(5), 4, caching, false).unwrap();
            // Positions 5 and 6 go into block 1 in place; 7 fills it (keyed when caching).
            assert_eq!(m.in_place_end(&rec, &plan), if caching { 7 } else { 8 });
            // Only the entries the engine's table holds count.
            let short = EngineRecord {
                table_len: 1,
                ..rec
            };
            assert_eq!(m.in_place_end(&short, &plan), 6);
        }
    }

    #[test]
    fn a_run_applies_at_once_where_it_was_planned_and_nowhere_else() {
        for caching in [false, true] {
            let mut cfg = Config::new(8, 4);
            cfg.enable_prefix_caching = caching;
            let m = BlockManager::new(cfg).unwrap();
            m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
                .unwrap()
                .unwrap();
            let h = m.seq_handle(1).unwrap();
            let mut rec = record(5);
            // Not where the sequence is: refused, nothing changed.
            let mut behind = EngineRecord { known: 4, ..rec };
            assert!(m.append_run(&mut behind, &h, &[9]).is_err());
            // Past the block (caching: filling it wants its key): refused.
            let over: &[u32] = if caching { &[6, 7, 8] } else { &[6, 7, 8, 9] };
            assert!(m.append_run(&mut rec, &h, over).is_err());
            assert_eq!((m.num_tokens(1).unwrap(), rec.known), (5, 5));
            m.append_run(&mut rec, &h, &[6, 7]).unwrap();
            assert_eq!(
                (m.num_tokens(1).unwrap(), rec.known, rec.scheduled),
                (7, 7, 7)
            );
            // A fork shares the block: no longer in place.
            m.fork(1, 2).unwrap();
            assert!(m.append_run(&mut rec, &h, &[8]).is_err());
            assert_eq!(m.num_tokens(1).unwrap(), 7);
            m.check_invariants().unwrap();
        }
    }

    #[test]
    fn a_shared_last_block_a_stale_record_or_a_freed_sequence_is_not_in_place() {
        let m = BlockManager::new(Config::new(8, 4)).unwrap();
        m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
            .unwrap()
            .unwrap();
        let h = m.seq_handle(1).unwrap();
        let rec = record(5);
        let plan = rec.plan_decode(&call(5), 4, false, false).unwrap();
        assert!(m.decode_in_place(&rec, &h, &plan).unwrap());
        // A record that lags the sequence.
        let stale = EngineRecord {
            known: 4,
            scheduled: 4,
            ..rec
        };
        let p = stale.plan_decode(&call(4), 4, false, false).unwrap();
        assert!(!m.decode_in_place(&stale, &h, &p).unwrap());
        // A fork shares the partial last block: the next token must copy it.
        m.fork(1, 2).unwrap();
        assert!(!m.decode_in_place(&rec, &h, &plan).unwrap());
        m.free(2).unwrap();
        assert!(m.decode_in_place(&rec, &h, &plan).unwrap());
        m.free(1).unwrap();
        assert!(!m.decode_in_place(&rec, &h, &plan).unwrap());
    }

    #[test]
    fn a_step_that_fills_its_block_applies_with_the_blocks_key() {
        let m = BlockManager::new(Config::new(8, 4)).unwrap();
        let key = |s: &str| s.as_bytes().to_vec();
        let prompt_keys = [key("k0")];
        let opts = crate::AllocateOpts {
            keys: crate::PromptKeys {
                block_hashes: Some(&prompt_keys),
                ..Default::default()
            },
            ..Default::default()
        };
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        m.allocate_with(1, &mut tokens.to_vec(), &opts)
            .unwrap()
            .unwrap();
        let h = m.seq_handle(1).unwrap();
        let rec = records::record(7);
        // Token 8 fills block 1: the plan hands over its key, still in place.
        let plan = rec
            .plan_decode(&records::call(7, 1, 8), 4, true, false)
            .unwrap();
        assert_eq!(plan.keys, 1..2);
        assert!(!plan.is_one_token(rec.table_len, 4));
        assert!(m.decode_in_place(&rec, &h, &plan).unwrap());
        // A record whose keys lag the sequence's plans two keys: not one step's key.
        let behind = EngineRecord { keys: 0, ..rec };
        let p = behind
            .plan_decode(&records::call(7, 1, 8), 4, true, false)
            .unwrap();
        assert_eq!(p.keys, 0..2);
        assert!(!m.decode_in_place(&behind, &h, &p).unwrap());
        // A key that would not continue the sequence's keys (it holds none: block 0's key
        // never came) is left to the general path.
        let other = BlockManager::new(Config::new(8, 4)).unwrap();
        let no_keys = crate::AllocateOpts {
            keys: crate::PromptKeys {
                block_hashes: Some(&[]),
                ..Default::default()
            },
            ..Default::default()
        };
        other
            .allocate_with(1, &mut tokens.to_vec(), &no_keys)
            .unwrap()
            .unwrap();
        let h_other = other.seq_handle(1).unwrap();
        assert!(plan.is_one_token_keyed(rec.table_len, 4));
        assert!(!other.decode_in_place(&rec, &h_other, &plan).unwrap());
        let all = [key("k0"), key("k1")];
        let lookup = crate::PromptKeys {
            block_hashes: Some(&all),
            ..Default::default()
        };
        let probe = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(m.lookup_with(&probe, &lookup).unwrap(), 4);
        let out = m
            .append_planned(&[&h], &[7], &[8], &[Some(key("k1"))])
            .unwrap();
        assert_eq!(out, Some(vec![]));
        assert_eq!(m.num_block_hashes(1).unwrap(), 2);
        assert_eq!(m.lookup_with(&probe, &lookup).unwrap(), 8, "block 1 cached");
        m.check_invariants().unwrap();
    }

    #[test]
    fn planned_steps_apply_together_or_not_at_all() {
        let m = BlockManager::new(Config::new(8, 4)).unwrap();
        m.allocate(1, &[1, 2, 3], None, None, 0).unwrap().unwrap();
        m.allocate(2, &[1, 2], None, None, 0).unwrap().unwrap();
        let (h1, h2) = (m.seq_handle(1).unwrap(), m.seq_handle(2).unwrap());
        // A count that is not the sequence's: nothing changes.
        assert!(m
            .append_planned(&[&h1, &h2], &[3, 3], &[4, 3], &[None, None])
            .is_err());
        assert_eq!((m.num_tokens(1).unwrap(), m.num_tokens(2).unwrap()), (3, 2));
        // The same sequence twice: refused, nothing changes.
        assert!(m
            .append_planned(&[&h1, &h1], &[3, 3], &[4, 4], &[None, None])
            .is_err());
        assert_eq!(m.num_tokens(1).unwrap(), 3);
        let out = m
            .append_planned(&[&h1, &h2], &[3, 2], &[4, 3], &[None, None])
            .unwrap();
        assert_eq!(out, Some(vec![]));
        assert_eq!((m.num_tokens(1).unwrap(), m.num_tokens(2).unwrap()), (4, 3));
        assert_eq!(m.num_scheduled_tokens(1).unwrap(), 4);
        // A freed sequence, or another manager's handle, is refused.
        m.free(2).unwrap();
        assert!(matches!(
            m.append_planned(&[&h2], &[3], &[4], &[None]),
            Err(crate::error::Error::UnknownSequence(2))
        ));
        let other = BlockManager::new(Config::new(8, 4)).unwrap();
        other.allocate(1, &[1], None, None, 0).unwrap().unwrap();
        let theirs = other.seq_handle(1).unwrap();
        assert!(m.append_planned(&[&theirs], &[1], &[2], &[None]).is_err());
    }
}
