//! What the scheduling loop (`sched_loop`) is given: the workload's requests, the options of
//! the chunked-prefill configuration the sizing replays use, and the sizing checks' stop rule
//! (`python/pagedkv/sim/check_bound.py`'s `StopRule`, evaluated here after every step).

use crate::trace_tokens::hash_id_tokens;
use std::collections::HashMap;

/// A request's prompt: its tokens, or a trace's hash ids (turned into tokens at each
/// admission, as `requests.Request.prompt` does, so a long trace never sits in memory whole).
#[derive(Clone, Debug)]
pub enum Prompt {
    Tokens(Vec<u32>),
    HashIds { ids: Vec<u64>, block_tokens: usize },
}

/// One request (`python/pagedkv/sim/requests.py`'s `Request`, without beams).
#[derive(Clone, Debug)]
pub struct Request {
    pub id: u64,
    pub prompt: Prompt,
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    /// Parallel samples: forked when the prompt is first fully scheduled.
    pub samples: usize,
    pub cache_salt: Option<Vec<u8>>,
    /// The miss-ratio curve's chain root for this salt (`block_keys.root`); 0 without a watch.
    pub root: u64,
    pub arrival_step: u64,
    /// Arrives `delay` steps after request `after` ended (and not before `arrival_step`).
    pub after: Option<u64>,
    pub delay: u64,
}

impl Request {
    /// The prompt's tokens (built from the hash ids for a trace request).
    pub fn prompt_tokens(&self) -> Vec<u32> {
        match &self.prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::HashIds { ids, block_tokens } => {
                hash_id_tokens(ids, self.prompt_len, *block_tokens)
            }
        }
    }
}

/// `StopRule`: a sizing check run stops as soon as it can no longer pass.
#[derive(Clone, Debug)]
pub struct StopRule {
    /// The target hit rate times the workload's prompt tokens (less the rule's tolerance).
    pub target_hits: f64,
    pub prompt_tokens: u64,
    /// Admitted prompt tokens so far -> the most the prompts not yet admitted can hit.
    pub rest: Option<HashMap<u64, u64>>,
}

/// The scheduler's options (`run_workload`'s, for chunked prefill).
#[derive(Clone, Debug)]
pub struct Options {
    /// Running sequences at most.
    pub max_batch: usize,
    /// `max_num_batched_tokens`: the per-step token budget.
    pub budget: usize,
    /// `long_prefill_token_threshold` (0: no cap).
    pub long_prefill_token_threshold: usize,
    /// The Python scheduler's `skip_sure_checks` (False: always ask the hit-aware
    /// `can_allocate`).
    pub skip_sure_checks: bool,
    /// Keep every manager call and its answer (`Logged`).
    pub record: bool,
    pub stop: Option<StopRule>,
}

/// Input the loop refuses, before it changes anything.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InputError {
    #[error("max_batch must be >= 1")]
    MaxBatch,
    #[error("max_num_batched_tokens must be >= 1")]
    Budget,
    #[error("request {0}: prompt_len is {1} but its prompt has {2} tokens")]
    PromptLen(u64, usize, usize),
    #[error("request {0}: prompt_len must be >= 1")]
    EmptyPrompt(u64),
    #[error("request {0}: num_samples must be >= 1")]
    Samples(u64),
    #[error("request id {0} appears twice")]
    Duplicate(u64),
}

pub(crate) fn check(requests: &[Request], options: &Options) -> Result<(), InputError> {
    if options.max_batch < 1 {
        return Err(InputError::MaxBatch);
    }
    if options.budget < 1 {
        return Err(InputError::Budget);
    }
    let mut seen = std::collections::HashSet::with_capacity(requests.len());
    for r in requests {
        if !seen.insert(r.id) {
            return Err(InputError::Duplicate(r.id));
        }
        if r.prompt_len == 0 {
            return Err(InputError::EmptyPrompt(r.id));
        }
        if r.samples == 0 {
            return Err(InputError::Samples(r.id));
        }
        let have = match &r.prompt {
            Prompt::Tokens(t) => t.len(),
            Prompt::HashIds { ids, block_tokens } => ids.len().saturating_mul(*block_tokens),
        };
        let short = match &r.prompt {
            Prompt::Tokens(_) => have != r.prompt_len,
            Prompt::HashIds { .. } => have < r.prompt_len,
        };
        if short {
            return Err(InputError::PromptLen(r.id, r.prompt_len, have));
        }
    }
    Ok(())
}
