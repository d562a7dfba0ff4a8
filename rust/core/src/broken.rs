//! The broken-manager guard (docs/concurrency.md): a panic or an `Error::Broken` inside a
//! call means the state may be half changed, so the manager refuses every later change.

use crate::error::{Error, Result};
use crate::sync::{lock, AtomicBool, Mutex, Ordering};
use std::panic::{catch_unwind, AssertUnwindSafe};

#[derive(Default)]
pub(crate) struct BrokenGuard {
    /// Set once, never cleared. Relaxed: a flag checked on its own; the message is under
    /// its own lock.
    flag: AtomicBool,
    /// The first failure's description (empty until then).
    reason: Mutex<String>,
}

impl BrokenGuard {
    pub fn is_broken(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }

    /// Run one public call: a panic or a `Broken` error marks the manager broken and comes
    /// back as `Error::Broken`; once broken, mutating calls are refused before they start.
    pub fn guarded<T>(&self, mutating: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if mutating && self.is_broken() {
            return Err(Error::Broken(lock(&self.reason).clone()));
        }
        let out = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(out) => out,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_owned());
                Err(Error::Broken(format!("internal error: {what}")))
            }
        };
        if let Err(Error::Broken(reason)) = &out {
            let mut slot = lock(&self.reason);
            if slot.is_empty() {
                slot.clone_from(reason);
            }
            self.flag.store(true, Ordering::Relaxed);
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_panic_breaks_changes_but_not_reads() {
        let g = BrokenGuard::default();
        assert_eq!(g.guarded(true, || Ok(1)), Ok(1));
        let out: Result<()> = g.guarded(true, || panic!("boom"));
        assert_eq!(out, Err(Error::Broken("internal error: boom".into())));
        assert!(g.is_broken());
        assert!(matches!(g.guarded(true, || Ok(2)), Err(Error::Broken(m)) if m.contains("boom")));
        assert_eq!(g.guarded(false, || Ok(3)), Ok(3), "reads still answer");
        // A later failure keeps the first reason.
        let _ = g.guarded(false, || Err::<(), _>(Error::Broken("second".into())));
        assert!(matches!(g.guarded(true, || Ok(())), Err(Error::Broken(m)) if m.contains("boom")));
    }
}
