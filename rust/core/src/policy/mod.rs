//! One small policy per kind of KV-cache group (docs/semantics.md, "KV-cache groups"):
//! `kind` (which leading tokens each kind no longer needs), `hit` (the longest prefix every
//! group can serve, vLLM's coordinator) and `reach` (which full blocks a window group caches
//! under sparse retention). The manager applies them to every layout; one
//! full-attention group is the case where both are trivial.

mod hit;
mod kind;
mod reach;

pub use hit::{hybrid_hit, Resume};
pub use kind::GroupKind;
pub use reach::{caches_block, check_interval};

/// The most groups one manager takes (a block's group and an event's index fit a byte).
pub const MAX_GROUPS: usize = 64;
