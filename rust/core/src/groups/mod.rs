//! KV-cache groups for hybrid models (full, sliding-window, chunked-local and state layers):
//! `kind` (what each keeps), `pool` (one pool of pages for all groups), `table` (a
//! sequence's tables), `hit` (the hybrid prefix hit), `manager` (the operations), `batch`,
//! `swap`, `queries`, `audit`. Contract: docs/semantics.md, "KV-cache groups".

mod audit;
mod batch;
mod hit;
mod kind;
mod manager;
mod pool;
mod queries;
mod swap;
mod table;

pub use kind::GroupKind;
pub use manager::{GroupManager, MAX_GROUPS};
pub use pool::NULL;
pub use queries::GroupStats;
