//! The pool's eviction order: the lock-free LRU queue (the default), or a policy in locked
//! mode (`eviction`).
//!
//! Locked mode's rule: every transition of a block into or out of CACHED happens while the
//! caller holds `Locked`'s mutex, and the policy is told of it before the mutex is released.
//! The transitions and who makes them (`block_pool`): a release to CACHED (`release_table`,
//! `unpin`), a revival by a prefix hit (`pin`), an eviction (`evict_into`), a withdrawal
//! (`withdraw`) and a reset. A hit on a block that is already OWNED changes no CACHED state
//! and stays lock-free; so does every release that leaves the block OWNED or FREE. So the
//! policy's set is exactly the CACHED blocks whenever the mutex is free, and an eviction under
//! the mutex always claims its victim. Lock order: this mutex, then a digest stripe, then the
//! event log (as the LRU queue's).

use crate::error::{Error, Result};
use crate::eviction::{new_policy, EvictionKind, Policy};
use crate::lru_queue::LruQueue;
use crate::sync::{lock, Mutex, MutexGuard, Padded};

pub enum EvictionOrder {
    /// Least recently released first, hits lock-free (`lru_queue`).
    Lru(LruQueue),
    /// Any other policy; the mutex guards the policy and orders every CACHED transition
    /// (module docs).
    Locked(Padded<Mutex<Box<dyn Policy>>>),
}

impl EvictionOrder {
    pub fn new(kind: EvictionKind, num_blocks: usize) -> Result<Self> {
        Ok(match new_policy(kind, num_blocks)? {
            None => Self::Lru(LruQueue::new(num_blocks)?),
            Some(policy) => Self::Locked(Padded(Mutex::new(policy))),
        })
    }

    /// A pool running `policy` in locked mode (tests of the locked paths with a plain order).
    #[cfg(test)]
    pub fn locked(policy: Box<dyn Policy>) -> Self {
        Self::Locked(Padded(Mutex::new(policy)))
    }

    /// The policy's lock, in locked mode.
    pub fn guard(&self) -> Option<MutexGuard<'_, Box<dyn Policy>>> {
        match self {
            Self::Lru(_) => None,
            Self::Locked(m) => Some(lock(m)),
        }
    }

    pub fn is_locked(&self) -> bool {
        matches!(self, Self::Locked(_))
    }
}

/// A policy broke locked mode's rule (a bug): what the pool reports.
pub fn out_of_step(what: &str, block: u32) -> Error {
    Error::Broken(format!(
        "eviction policy out of step with the block states: {what} block {block}"
    ))
}
