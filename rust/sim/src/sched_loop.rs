//! The replay's per-step scheduling loop for chunked prefill, driving the core manager
//! directly: `python/pagedkv/sim/scheduler.py` is the reference, and this makes the same
//! manager calls with the same arguments in the same order (tests/sim/test_sim_rust_loop.py
//! compares them call for call). In scope: chunked prefill with a token budget, the
//! per-request chunk cap, `max_batch`, parallel samples (forked at admission), preemption by
//! recompute and by swap (when the manager has CPU blocks), chat follow-ups' arrival rule,
//! the sizing checks' stop rule and the miss-ratio curve's streams, on any manager (hybrid
//! KV-cache groups included: with several groups the hit-aware check is always asked). Beams, speculative
//! decoding, aborts, tiers, whole-prompt scheduling and Python observers stay on the Python
//! loop (`pagedkv.sim.rust_loop` picks).
//!
//! One step (the module docstring of scheduler.py numbers the phases): arrivals; swap-ins;
//! the decode of every fully scheduled sequence (`sched_phases::decode`); the partial
//! prefills (`prefill`); admissions (`admit`); the step runs; the per-step samples; the
//! finished sequences leave.

use crate::mrc_stream::{MrcStream, StreamError};
use crate::sched_input::{check, InputError, Options, Request};
use crate::sched_log::{Answer, Call, Counters, Logged, Outcome, Series};
use pagedkv_core::{BlockManager, Error as CoreError, Result as CoreResult};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Instant;

#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("miss-ratio stream: {0}")]
    Watch(#[from] StreamError),
    /// Nothing runs and nothing could be admitted (the Python loop's RuntimeError).
    #[error("scheduler made no progress")]
    NoProgress,
    /// The caller's per-step hook asked to stop (a Python exception waits in the binding).
    #[error("stopped by the caller")]
    Stopped,
}

/// A sequence (the Python loop's `_Seq`).
#[derive(Clone, Debug)]
pub(crate) struct Seq {
    pub(crate) id: u64,
    pub(crate) req: usize,
    pub(crate) generated: usize,
    pub(crate) forked: bool,
    /// Who generated which tokens: (owner seq id, first position).
    pub(crate) segments: Vec<(u64, usize)>,
    pub(crate) scheduled: usize,
    pub(crate) computed: usize,
    pub(crate) chunks: usize,
    pub(crate) admitted: bool,
}

/// `requests.generated_token`: the token a sequence "samples" at `position`.
pub fn generated_token(seq_id: u64, position: u64) -> u32 {
    let mixed = seq_id.wrapping_mul(0x9E37_79B1) ^ position.wrapping_mul(0x85EB_CA77);
    ((mixed & 0xFFFF_FFFF) % 32_000) as u32
}

pub(crate) struct Loop<'a> {
    pub(crate) m: &'a BlockManager,
    pub(crate) reqs: &'a [Request],
    pub(crate) opts: &'a Options,
    pub(crate) watches: Vec<&'a mut MrcStream>,
    pub(crate) c: Counters,
    pub(crate) series: Series,
    pub(crate) log: Option<Vec<Logged>>,
    /// Every sequence ever made; the queues hold indices into it.
    pub(crate) seqs: Vec<Seq>,
    pub(crate) waiting: VecDeque<usize>,
    pub(crate) swapped: VecDeque<usize>,
    pub(crate) running: Vec<usize>,
    arrivals: BinaryHeap<Reverse<(u64, u64)>>,
    by_id: HashMap<u64, usize>,
    dependents: HashMap<u64, Vec<usize>>,
    live: HashMap<u64, usize>,
    pub(crate) next_id: u64,
    pub(crate) clock: u64,
    /// (available blocks, chunk) when the queue's head last failed to allocate.
    pub(crate) blocked_at: (i64, usize),
    pub(crate) one_group: bool,
    pub(crate) use_swap: bool,
    pub(crate) chunk_cap: usize,
    pub(crate) budget: i64,
    pub(crate) preempted: bool,
}

/// Replay `requests` through `manager` (see the module docstring). `step_hook(finished
/// requests, requests)` is called after every step; false stops the run (`Stopped`).
pub fn run_schedule(
    manager: &BlockManager,
    requests: &[Request],
    options: &Options,
    watches: Vec<&mut MrcStream>,
    step_hook: &mut dyn FnMut(u64, u64) -> bool,
) -> Result<Outcome, LoopError> {
    check(requests, options)?;
    let mut l = Loop::new(manager, requests, options, watches);
    while !(l.arrivals.is_empty()
        && l.waiting.is_empty()
        && l.swapped.is_empty()
        && l.running.is_empty())
    {
        l.arrive();
        l.step()?;
        l.clock += 1;
        if !step_hook(l.c.finished_requests, l.c.requests) {
            return Err(LoopError::Stopped);
        }
        if l.should_stop() {
            l.c.stopped_early = true;
            break;
        }
    }
    l.c.clock_steps = l.clock;
    Ok(Outcome {
        counters: l.c,
        series: l.series,
        log: l.log,
    })
}

impl<'a> Loop<'a> {
    fn new(
        m: &'a BlockManager,
        reqs: &'a [Request],
        opts: &'a Options,
        watches: Vec<&'a mut MrcStream>,
    ) -> Self {
        let by_id: HashMap<u64, usize> = reqs.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
        let mut arrivals = BinaryHeap::with_capacity(reqs.len());
        let mut dependents: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, r) in reqs.iter().enumerate() {
            match r.after {
                Some(p) if by_id.contains_key(&p) => dependents.entry(p).or_default().push(i),
                _ => arrivals.push(Reverse((r.arrival_step, r.id))),
            }
        }
        let next_id = reqs.iter().map(|r| r.id + 1).max().unwrap_or(0);
        let config = m.config();
        Loop {
            m,
            reqs,
            opts,
            watches,
            c: Counters {
                requests: reqs.len() as u64,
                ..Counters::default()
            },
            series: Series::default(),
            log: opts.record.then(Vec::new),
            seqs: Vec::with_capacity(reqs.len()),
            waiting: VecDeque::new(),
            swapped: VecDeque::new(),
            running: Vec::new(),
            arrivals,
            by_id,
            dependents,
            live: HashMap::new(),
            next_id,
            clock: 0,
            blocked_at: (-1, 0),
            one_group: m.kinds().len() == 1,
            use_swap: config.num_cpu_blocks > 0,
            chunk_cap: if opts.long_prefill_token_threshold > 0 {
                opts.long_prefill_token_threshold
            } else {
                1 << 62
            },
            budget: 0,
            preempted: false,
        }
    }

    /// A manager call, timed; `call` describes it for the log (built only when recording).
    pub(crate) fn call<T>(
        &mut self,
        f: impl FnOnce(&BlockManager) -> CoreResult<T>,
        call: impl FnOnce() -> Call,
        answer: impl FnOnce(&T) -> Answer,
    ) -> Result<T, LoopError> {
        let t0 = Instant::now();
        let out = f(self.m);
        self.c.manager_ns += t0.elapsed().as_nanos() as u64;
        self.c.manager_calls += 1;
        let out = out?;
        if let Some(log) = &mut self.log {
            log.push(Logged {
                call: call(),
                answer: answer(&out),
            });
        }
        Ok(out)
    }

    pub(crate) fn num_tokens(&self, s: usize) -> usize {
        let q = &self.seqs[s];
        self.reqs[q.req].prompt_len + q.generated
    }

    /// Prompt plus generated tokens: what a (re)computation allocates.
    pub(crate) fn all_tokens(&self, s: usize) -> Vec<u32> {
        let q = &self.seqs[s];
        let mut out = self.reqs[q.req].prompt_tokens();
        if q.generated == 0 {
            return out;
        }
        let end = self.num_tokens(s);
        for (i, &(owner, start)) in q.segments.iter().enumerate() {
            let next = q.segments.get(i + 1).map_or(end, |x| x.1);
            let stop = next.min(end);
            out.extend((start..stop).map(|p| generated_token(owner, p as u64)));
        }
        out
    }

    fn arrive(&mut self) {
        if self.waiting.is_empty() && self.swapped.is_empty() && self.running.is_empty() {
            if let Some(Reverse((at, _))) = self.arrivals.peek() {
                self.clock = self.clock.max(*at); // skip the idle stretch
            }
        }
        while let Some(&Reverse((at, rid))) = self.arrivals.peek() {
            if at > self.clock {
                break;
            }
            self.arrivals.pop();
            let req = self.by_id[&rid];
            self.join(req);
        }
    }

    fn join(&mut self, req: usize) {
        let r = &self.reqs[req];
        self.seqs.push(Seq {
            id: r.id,
            req,
            generated: 0,
            forked: false,
            segments: vec![(r.id, r.prompt_len)],
            scheduled: 0,
            computed: 0,
            chunks: 0,
            admitted: false,
        });
        self.waiting.push_back(self.seqs.len() - 1);
        self.live.insert(r.id, 1);
    }

    /// A sequence ended (finished or rejected); maybe its request too.
    pub(crate) fn end(&mut self, s: usize) {
        let rid = self.reqs[self.seqs[s].req].id;
        let left = self.live.get_mut(&rid).expect("a live request");
        *left -= 1;
        if *left > 0 {
            return;
        }
        self.live.remove(&rid);
        self.c.finished_requests += 1;
        for d in self.dependents.remove(&rid).unwrap_or_default() {
            // A trace's follow-up keeps its logged arrival unless its parent ends later.
            let r = &self.reqs[d];
            let at = (self.clock + 1 + r.delay).max(r.arrival_step);
            self.arrivals.push(Reverse((at, r.id)));
        }
    }

    pub(crate) fn reject(&mut self, s: usize) {
        let q = &self.seqs[s];
        if !q.forked {
            self.c.rejected_sequences += self.reqs[q.req].samples as u64;
            self.c.rejected_requests += 1;
        } else {
            self.c.rejected_sequences += 1;
        }
        self.end(s);
    }

    /// Free a resident sequence; the tokens scheduled in this step were never computed.
    pub(crate) fn free(&mut self, s: usize) -> Result<(), LoopError> {
        let (id, computed, scheduled) = {
            let q = &self.seqs[s];
            (q.id, q.computed, q.scheduled)
        };
        let c = (computed < scheduled).then_some(computed);
        self.call(
            |m| m.free_computed(id, c),
            || Call::Free(id, c),
            |_| Answer::Done,
        )?;
        for w in &mut self.watches {
            w.free(id)?;
        }
        Ok(())
    }

    fn fork(&mut self, parent: usize) -> Result<(), LoopError> {
        let child_id = self.next_id;
        let p = &self.seqs[parent];
        let mut segments = p.segments.clone();
        segments.push((child_id, self.reqs[p.req].prompt_len + p.generated));
        let child = Seq {
            id: child_id,
            req: p.req,
            generated: p.generated,
            forked: true,
            segments,
            scheduled: p.scheduled,
            computed: p.computed,
            chunks: 0,
            admitted: true,
        };
        let parent_id = p.id;
        let rid = self.reqs[p.req].id;
        self.next_id += 1;
        self.c.forks += 1;
        *self.live.get_mut(&rid).expect("a live request") += 1;
        self.call(
            |m| m.fork(parent_id, child_id),
            || Call::Fork(parent_id, child_id),
            |_| Answer::Done,
        )?;
        for w in &mut self.watches {
            w.fork(parent_id, child_id)?;
        }
        self.seqs.push(child);
        self.running.push(self.seqs.len() - 1);
        Ok(())
    }

    /// Its prompt is fully scheduled: fork its samples (first admission only).
    pub(crate) fn prefilled(&mut self, s: usize) -> Result<(), LoopError> {
        let q = &mut self.seqs[s];
        if q.chunks > 1 {
            self.c.chunked_prompts += 1;
        }
        q.chunks = 0;
        if !q.forked {
            q.forked = true;
            for _ in 1..self.reqs[q.req].samples {
                self.fork(s)?;
            }
        }
        Ok(())
    }

    pub(crate) fn preempt(&mut self, victim: usize) -> Result<(), LoopError> {
        self.preempted = true;
        let q = &self.seqs[victim];
        // A sequence scheduled in this step is never swapped out: free it and recompute it.
        if self.use_swap && q.computed == q.scheduled {
            let id = q.id;
            let pairs = self.call(
                |m| m.swap_out(id),
                || Call::SwapOut(id),
                |p| Answer::Pairs(p.clone()),
            )?;
            if pairs.is_some() {
                self.c.preempted_swap += 1;
                self.swapped.push_back(victim);
                for w in &mut self.watches {
                    w.swap_out(id)?;
                }
                return Ok(());
            }
        }
        self.free(victim)?;
        let q = &mut self.seqs[victim];
        q.scheduled = 0;
        q.computed = 0;
        q.chunks = 0;
        self.c.preempted_recompute += 1;
        self.waiting.push_front(victim);
        Ok(())
    }

    /// One executed step at `self.clock`.
    fn step(&mut self) -> Result<(), LoopError> {
        self.c.steps += 1;
        let ns0 = self.c.manager_ns;
        let tokens0 = self.c.scheduled_tokens;
        let preempted0 = self.c.preemptions();
        self.preempted = false;
        self.schedule()?;
        // The step ran: each sequence's scheduled tokens are computed.
        let bs = self.m.block_size();
        let (mut live, mut reserved, mut finished) = (0usize, 0usize, false);
        for &s in &self.running {
            let q = &mut self.seqs[s];
            q.computed = q.scheduled;
            live += q.scheduled;
            reserved += q.scheduled.div_ceil(bs) * bs;
            finished = finished || q.generated >= self.reqs[q.req].max_new_tokens;
        }
        let num_blocks = self.m.config().num_blocks as usize;
        let cached = self.m.num_cached_blocks();
        let used = num_blocks - self.m.num_free_blocks() - cached;
        let sr = &mut self.series;
        sr.usage.push(used as f64 / num_blocks as f64);
        sr.cached_blocks.push(cached as u64);
        sr.running.push(self.running.len() as u64);
        sr.waiting.push(self.waiting.len() as u64);
        sr.swapped.push(self.swapped.len() as u64);
        sr.live_tokens.push(live as u64);
        if finished {
            self.retire()?;
        }
        let frag = if reserved > 0 {
            1.0 - live as f64 / reserved as f64
        } else {
            0.0
        };
        let sr = &mut self.series;
        sr.fragmentation.push(frag);
        sr.hit_rate.push(self.c.workload_hit_rate());
        sr.manager_ns.push(self.c.manager_ns - ns0);
        sr.scheduled_tokens.push(self.c.scheduled_tokens - tokens0);
        sr.preemptions.push(self.c.preemptions() - preempted0);
        sr.step.push(self.clock);
        Ok(())
    }

    /// Phases 2-6 of a step.
    fn schedule(&mut self) -> Result<(), LoopError> {
        self.swap_in()?;
        self.budget = self.opts.budget as i64;
        if !self.decode()? {
            self.running.clear();
        }
        self.prefill()?;
        self.admit()?;
        if self.running.is_empty() && !(self.waiting.is_empty() && self.swapped.is_empty()) {
            return Err(LoopError::NoProgress);
        }
        Ok(())
    }

    /// Free the finished sequences.
    fn retire(&mut self) -> Result<(), LoopError> {
        let (done, still): (Vec<usize>, Vec<usize>) = self.running.iter().partition(|&&s| {
            let q = &self.seqs[s];
            q.generated >= self.reqs[q.req].max_new_tokens
        });
        let ids: Vec<u64> = done.iter().map(|&s| self.seqs[s].id).collect();
        self.call(
            |m| m.free_batch(&ids),
            || Call::FreeBatch(ids.clone()),
            |_| Answer::Done,
        )?;
        self.c.finished_sequences += done.len() as u64;
        for s in done {
            self.c.output_tokens += self.seqs[s].generated as u64;
            let id = self.seqs[s].id;
            for w in &mut self.watches {
                w.free(id)?;
            }
            self.end(s);
        }
        self.running = still;
        Ok(())
    }

    /// `StopRule.__call__`: true as soon as the run can no longer pass.
    fn should_stop(&self) -> bool {
        let Some(rule) = &self.opts.stop else {
            return false;
        };
        let c = &self.c;
        if c.preemptions() > 0 || c.rejected_requests > 0 {
            return true;
        }
        let admitted = c.workload_prompt_tokens();
        let hits = c.prefix_hit_tokens - c.recomputed_hit_tokens;
        let rest = rule
            .rest
            .as_ref()
            .and_then(|r| r.get(&admitted).copied())
            .unwrap_or_else(|| rule.prompt_tokens.saturating_sub(admitted));
        ((hits + rest) as f64) < rule.target_hits
    }
}
