//! What the scheduling loop reports: the figures `SimResult` holds (`Counters`, and `Series`
//! with one entry per executed step), and, when asked, every manager call it made with the
//! answer it got (`Logged`), so that a test can compare it call for call with the Python
//! scheduler's `TimedCalls` record.

use pagedkv_core::AllocStatus;

type Pairs = Vec<(u32, u32)>;

/// A manager call, with its arguments as the Python scheduler passes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    CanSwapIn(u64),
    SwapIn(u64),
    SwapOut(u64),
    /// `can_allocate(num_tokens)`: by count, no hit counted.
    CanAllocateCount(usize),
    /// `can_allocate(tokens, num_new_tokens=chunk, cache_salt=...)`; `request`: the index of
    /// the request whose salt it passes.
    CanAllocate {
        tokens: Vec<u32>,
        chunk: usize,
        request: usize,
    },
    /// `allocate(seq_id, tokens, cache_salt=..., num_new_tokens=chunk)`.
    Allocate {
        seq_id: u64,
        tokens: Vec<u32>,
        chunk: usize,
        request: usize,
    },
    Extend(u64, usize),
    AppendBatch(Vec<u64>, Vec<u32>),
    /// `free(seq_id)`, or `free(seq_id, num_computed_tokens=c)` with `Some(c)`.
    Free(u64, Option<usize>),
    FreeBatch(Vec<u64>),
    Fork(u64, u64),
}

/// A manager call's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Status(AllocStatus),
    Hit(Option<usize>),
    Pairs(Option<Pairs>),
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    pub call: Call,
    pub answer: Answer,
}

/// `SimResult`'s counters (the names are its fields').
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub requests: u64,
    pub finished_requests: u64,
    pub rejected_requests: u64,
    pub steps: u64,
    pub clock_steps: u64,
    pub finished_sequences: u64,
    pub rejected_sequences: u64,
    pub forks: u64,
    pub preempted_recompute: u64,
    pub preempted_swap: u64,
    pub swap_ins: u64,
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub recomputed_tokens: u64,
    pub recomputed_hit_tokens: u64,
    pub decode_tokens: u64,
    pub output_tokens: u64,
    pub copy_pairs: u64,
    pub prefill_chunks: u64,
    pub extend_calls: u64,
    pub chunked_prompts: u64,
    pub scheduled_tokens: u64,
    pub decode_steps: u64,
    pub manager_calls: u64,
    pub manager_ns: u64,
    pub stopped_early: bool,
}

impl Counters {
    pub fn preemptions(&self) -> u64 {
        self.preempted_recompute + self.preempted_swap
    }

    /// Prompt tokens of the workload's own admissions (recomputes left out).
    pub fn workload_prompt_tokens(&self) -> u64 {
        self.prompt_tokens - self.recomputed_tokens
    }

    /// `SimResult.workload_hit_rate`.
    pub fn workload_hit_rate(&self) -> f64 {
        let hits = self.prefix_hit_tokens - self.recomputed_hit_tokens;
        let prompt = self.workload_prompt_tokens();
        if prompt == 0 {
            0.0
        } else {
            hits as f64 / prompt as f64
        }
    }
}

/// `StepSeries`: one entry per executed step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub step: Vec<u64>,
    pub usage: Vec<f64>,
    pub cached_blocks: Vec<u64>,
    pub running: Vec<u64>,
    pub waiting: Vec<u64>,
    pub swapped: Vec<u64>,
    pub hit_rate: Vec<f64>,
    pub fragmentation: Vec<f64>,
    pub manager_ns: Vec<u64>,
    pub scheduled_tokens: Vec<u64>,
    pub live_tokens: Vec<u64>,
    pub preemptions: Vec<u64>,
}

/// Everything one run reports.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub counters: Counters,
    pub series: Series,
    /// Every manager call and answer, with `Options::record`.
    pub log: Option<Vec<Logged>>,
}
