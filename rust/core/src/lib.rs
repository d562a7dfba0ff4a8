//! pagedkv-core: a paged KV-cache block manager with no Python dependency.
//!
//! The parts, one file each: `block_state` (one atomic word per block: refcount, hashed,
//! generation), `gate` (reset excludes every ownership change), `seq_map` (live ids and how
//! they come and go), `alloc` (fallible allocation), `duties` (the evictions a call must copy out, returned to it), `free_stack` (lock-free LIFO of free ids), `lru_queue` (eviction order of cached
//! blocks), `prefix_index` (digest -> block, lock-free reads), `block_pool` (the lifecycle
//! transitions and admission), `cpu_pool` (swap space), `hashing` (chained digests),
//! `hit_tag` (secret tags that confirm hits under a weak hash), `sequence` (a block table), `manager` (the operations), `batch`, `decode` (the one-token step), `running` (persistent running batches), `swap`, `audit`,
//! `events`, `stats`, `config`, `error`.
//!
//! Lifecycle of a GPU block (docs/semantics.md): FREE -> OWNED(rc >= 1) -> FREE (unhashed) or
//! CACHED (hashed, rc 0) -> OWNED (prefix hit) or evicted -> OWNED by a new holder.
//! FREE + OWNED + CACHED = num_blocks at every quiescent moment (`check_invariants`).

mod alloc;
mod audit;
mod batch;
mod block_pool;
mod block_state;
mod broken;
mod config;
mod counters;
mod cpu_pool;
mod decode;
pub mod duties;
#[cfg(all(test, not(loom)))]
mod duties_tests;
mod error;
mod events;
mod free_stack;
mod gate;
mod grouped;
#[cfg(all(test, not(loom)))]
mod guard_tests;
mod hashing;
mod hit_tag;
mod id_hasher;
#[cfg(all(test, not(loom)))]
mod lock_choice_tests;
#[cfg(all(test, loom))]
mod loom_models;
mod lru_queue;
mod manager;
mod policy;
mod pool_audit;
mod prefix_index;
mod running;
mod seq_map;
mod sequence;
mod stats;
mod swap;
mod sync;

pub use block_state::RC_MAX;
pub use config::{Config, MAX_BLOCKS};
pub use error::{Error, Result};
pub use events::{KvEvent, Medium};
pub use grouped::NULL;
pub use hashing::{encode_extras, BlockHasher, Digest, HashAlgo, Tag};
pub use manager::{BlockManager, MAX_TOKENS};
pub use policy::{GroupKind, MAX_GROUPS};
pub use running::{RunningBatch, StepOut};
pub use stats::{AllocStatus, GroupStats, Stats};
#[cfg(not(loom))]
pub use sync::nonblocking;
