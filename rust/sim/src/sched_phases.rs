//! The scheduling phases of one step (`sched_loop` runs them in order): swap-ins, the decode,
//! the partial prefills and the admissions, each making the Python scheduler's manager calls
//! (`python/pagedkv/sim/scheduler.py`: `_swap_in`, `_decode`, `_prefill`, `_admit`).

use crate::sched_log::{Answer, Call};
use crate::sched_loop::{generated_token, LoopError};
use pagedkv_core::{AllocStatus, AllocateOpts, PromptKeys, PromptLen};

use crate::sched_loop::Loop;

impl Loop<'_> {
    /// Swap in preempted sequences, oldest first, while they fit.
    pub(crate) fn swap_in(&mut self) -> Result<(), LoopError> {
        while let Some(&s) = self.swapped.front() {
            if self.running.len() >= self.opts.max_batch {
                break;
            }
            let id = self.seqs[s].id;
            let status = self.call(
                |m| m.can_swap_in(id),
                || Call::CanSwapIn(id),
                |st| Answer::Status(*st),
            )?;
            // LATER: wait for running sequences to finish. NEVER (it grew into the watermark)
            // with nothing else running: swap_in itself ignores the watermark, so try it.
            if status == AllocStatus::Later
                || (status == AllocStatus::Never && !self.running.is_empty())
            {
                break;
            }
            let pairs = self.call(
                |m| m.swap_in(id),
                || Call::SwapIn(id),
                |p| Answer::Pairs(p.clone()),
            )?;
            if pairs.is_none() {
                break;
            }
            self.swapped.pop_front();
            self.running.push(s);
            self.c.swap_ins += 1;
            for w in &mut self.watches {
                w.swap_in(id)?;
            }
        }
        Ok(())
    }

    /// One token for every fully scheduled sequence; false when nothing could run.
    pub(crate) fn decode(&mut self) -> Result<bool, LoopError> {
        let mut batch: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&s| self.seqs[s].scheduled == self.num_tokens(s))
            .collect();
        // Decodes come first in the budget.
        batch.truncate(self.budget.max(0) as usize);
        if batch.is_empty() {
            return Ok(true);
        }
        let mut ids: Vec<u64> = batch.iter().map(|&s| self.seqs[s].id).collect();
        let mut toks: Vec<u32> = batch
            .iter()
            .map(|&s| generated_token(self.seqs[s].id, self.num_tokens(s) as u64))
            .collect();
        let pairs = loop {
            let (i, t) = (ids.clone(), toks.clone());
            let got = self.call(
                |m| m.append_batch_lookahead(&ids, &toks, 0),
                || Call::AppendBatch(i, t),
                |p| Answer::Pairs(p.clone()),
            )?;
            if let Some(p) = got {
                break p;
            }
            let victim = self.running.pop().expect("a batch runs");
            if let Some(i) = batch.iter().position(|&s| s == victim) {
                batch.remove(i);
                ids.remove(i);
                toks.remove(i);
            }
            if self.running.is_empty() {
                // Even alone with the whole pool it cannot grow: give up on it.
                self.free(victim)?;
                self.reject(victim);
                return Ok(false);
            }
            self.preempt(victim)?;
            if batch.is_empty() {
                return Ok(true);
            }
        };
        let n = batch.len() as u64;
        self.c.copy_pairs += pairs.len() as u64;
        self.c.decode_tokens += n;
        self.c.decode_steps += n;
        self.c.scheduled_tokens += n;
        self.budget -= n as i64;
        for &s in &batch {
            let q = &mut self.seqs[s];
            q.generated += 1;
            q.scheduled += 1;
        }
        for w in &mut self.watches {
            w.decode(&ids, &toks)?;
        }
        Ok(true)
    }

    /// The partially prefilled sequences continue, oldest first.
    pub(crate) fn prefill(&mut self) -> Result<(), LoopError> {
        let snapshot = self.running.clone();
        let mut removed = false; // preempted in this pass: membership must be checked
        for s in snapshot {
            if self.budget <= 0 {
                return Ok(());
            }
            let q = &self.seqs[s];
            let n = q.scheduled;
            if n >= self.num_tokens(s) || n > q.computed || (removed && !self.running.contains(&s))
            {
                continue; // decoding, scheduled in this step already, or preempted meanwhile
            }
            let id = q.id;
            let chunk = (self.budget as usize)
                .min(self.num_tokens(s) - n)
                .min(self.chunk_cap);
            let pairs = loop {
                let got = self.call(
                    |m| m.extend_releasing(id, chunk, 0, true),
                    || Call::Extend(id, chunk),
                    |p| Answer::Pairs(p.clone()),
                )?;
                if got.is_some() {
                    break got;
                }
                // Preempt the newest sequence not yet scheduled in this step; itself if none.
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&v| v != s && self.seqs[v].scheduled == self.seqs[v].computed)
                    .unwrap_or(s);
                let at = self.running.iter().position(|&v| v == victim);
                self.running.remove(at.expect("the victim runs"));
                removed = true;
                self.preempt(victim)?;
                if victim == s {
                    break None;
                }
            };
            let Some(pairs) = pairs else { continue };
            self.seqs[s].scheduled += chunk;
            self.seqs[s].chunks += 1;
            for w in &mut self.watches {
                w.extend(id, chunk)?;
            }
            self.c.copy_pairs += pairs.len() as u64;
            self.c.extend_calls += 1;
            self.c.prefill_chunks += 1;
            self.c.scheduled_tokens += chunk as u64;
            self.budget -= chunk as i64;
            if self.seqs[s].scheduled == self.num_tokens(s) {
                self.prefilled(s)?;
            }
        }
        Ok(())
    }

    /// Admit waiting requests (FIFO) while the budget lasts and nothing was preempted.
    pub(crate) fn admit(&mut self) -> Result<(), LoopError> {
        if self.running.is_empty() {
            self.blocked_at = (-1, 0); // the whole pool is available: always try
        }
        while let Some(&s) = self.waiting.front() {
            if !self.swapped.is_empty()
                || self.running.len() >= self.opts.max_batch
                || self.budget <= 0
            {
                break;
            }
            if self.preempted && !self.running.is_empty() {
                break; // vLLM v1 admits nothing in a step that preempted
            }
            let n = self.num_tokens(s);
            let fits = self.call(
                |m| m.can_allocate_with(PromptLen::Count(n as u64), None, &PromptKeys::default()),
                || Call::CanAllocateCount(n),
                |st| Answer::Status(*st),
            )?;
            if fits == AllocStatus::Never {
                self.waiting.pop_front();
                self.reject(s);
                continue;
            }
            let chunk = (self.budget as usize).min(n).min(self.chunk_cap);
            let available = self.m.num_available_blocks() as i64;
            if available <= self.blocked_at.0 && chunk >= self.blocked_at.1 {
                break; // it did not fit last time and nothing was released since
            }
            let tokens = self.all_tokens(s);
            let (id, req) = (self.seqs[s].id, self.seqs[s].req);
            let salt = self.reqs[req].cache_salt.as_deref();
            let keys = PromptKeys {
                cache_salt: salt,
                ..PromptKeys::default()
            };
            // Hit-aware, asked only when the answer could be other than OK (scheduler.py).
            if !(fits == AllocStatus::Ok && self.one_group && self.opts.skip_sure_checks) {
                let status = self.call(
                    |m| m.can_allocate_with(PromptLen::Tokens(&tokens), Some(chunk as u64), &keys),
                    || Call::CanAllocate {
                        tokens: tokens.clone(),
                        chunk,
                        request: req,
                    },
                    |st| Answer::Status(*st),
                )?;
                if status != AllocStatus::Ok && !self.running.is_empty() {
                    break;
                }
            }
            // The core takes the tokens it is given; the watches and the log need them after.
            let keep = !self.watches.is_empty() || self.log.is_some();
            let (mut given, kept) = if keep {
                (tokens.clone(), tokens)
            } else {
                (tokens, Vec::new())
            };
            let opts = AllocateOpts {
                keys,
                num_new_tokens: Some(chunk),
                lookahead: 0,
                register: true,
                retention: None,
                reachable: None,
            };
            let hit = self.call(
                |m| m.allocate_with(id, &mut given, &opts),
                || Call::Allocate {
                    seq_id: id,
                    tokens: kept.clone(),
                    chunk,
                    request: req,
                },
                |h| Answer::Hit(*h),
            )?;
            let Some(hit) = hit else {
                self.blocked_at = (available, chunk);
                break;
            };
            self.blocked_at = (-1, 0);
            self.waiting.pop_front();
            let scheduled = hit + chunk.min(n - hit);
            let computed = scheduled - hit;
            let q = &mut self.seqs[s];
            q.scheduled = scheduled;
            q.computed = hit;
            q.chunks = 1;
            let recompute = q.admitted;
            q.admitted = true;
            let root = self.reqs[req].root;
            for w in &mut self.watches {
                w.allocate(id, &kept, scheduled, root);
            }
            let c = &mut self.c;
            c.prompt_tokens += n as u64;
            c.prefix_hit_tokens += hit as u64;
            if recompute {
                c.recomputed_tokens += n as u64;
                c.recomputed_hit_tokens += hit as u64;
            }
            c.prefill_chunks += 1;
            c.scheduled_tokens += computed as u64;
            self.budget -= computed as i64;
            self.running.push(s);
            if scheduled == n {
                self.prefilled(s)?;
            }
        }
        Ok(())
    }
}
