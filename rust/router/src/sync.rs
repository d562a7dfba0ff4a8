//! The atomics and locks of the protocols loom models (`loom_models/`): the holder slots'
//! words (`slots.rs`) and the replaced-holders queue (`replaced.rs`). Under `--cfg loom` they
//! are loom's, so the models run the crate's own code; everything else keeps std's.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};
