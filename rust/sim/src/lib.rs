//! pagedkv-sim: the parts of `pagedkv simulate` that are too slow in Python, with no Python
//! dependency (the binding in `rust/python` converts arguments only).
//!
//! - `block_keys`: 64-bit content keys of full blocks, chained over the prefix: the same
//!   arithmetic as `python/pagedkv/sim/block_keys.py`, so both give the same keys.
//! - `mrc_stream`: what the miss-ratio curve recorder hears from the scheduler, turned into
//!   an ordered stream of lookups and touches (`python/pagedkv/sim/mrc.py`'s `MRCRecorder`,
//!   the reference it is tested against).
//! - `stack`: exact LRU stack distances over that stream, and the curve's thresholds.
//! - `trace_tokens`: the pseudo-tokens of a trace prompt given as hash ids.
//! - `stream`: lookups and touches with each key's parent, as `mrc_stream` records them.
//! - `block_replay`: the same kind of stream straight from a trace's hash ids, at block
//!   granularity (a pure cache replay: no scheduler, no tokens).
//! - `policy_replay`: a stream through one cache size under LRU, FIFO or Belady's optimum
//!   under the prefix constraint.
//! - `sched_loop` (with `sched_input`, `sched_phases`, `sched_log`): the replay's per-step
//!   scheduling loop for chunked prefill, driving the core manager directly, call for call
//!   the Python scheduler's (`python/pagedkv/sim/scheduler.py`, the reference).

pub mod block_keys;
pub mod block_replay;
pub mod mrc_stream;
pub mod policy_replay;
pub mod sched_input;
pub mod sched_log;
pub mod sched_loop;
#[cfg(test)]
mod sched_loop_tests;
mod sched_phases;
pub mod stack;
pub mod stream;
pub mod trace_tokens;

pub use block_replay::{block_stream, ReplayError, TraceIds};
pub use mrc_stream::{MrcStream, StreamError};
pub use policy_replay::{hits, Policy};
pub use sched_input::{InputError, Options, Prompt, Request, StopRule};
pub use sched_log::{Answer, Call, Counters, Logged, Outcome, Series};
pub use sched_loop::{generated_token, run_schedule, LoopError};
pub use stack::Thresholds;
pub use stream::Stream;
pub use trace_tokens::hash_id_tokens;
