//! The manager's clock, in seconds: what retention durations count against.
//!
//! Monotonic (`Instant`) until a caller sets the time (`set`), then manual for good: tests and
//! simulations drive retention expiry exactly, one tick at a time. A manual time never goes
//! back (`set` refuses). Read under the policy lock by the priority policy; set by any thread.

use crate::error::{invalid, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

pub struct Clock {
    /// When the clock was made; monotonic time is measured from it.
    start: Instant,
    /// Set once `set` was called; never cleared. Acquire/Release with `manual`'s store.
    is_manual: AtomicBool,
    /// The manual time, as `f64` bits, minus infinity until the first `set`; only grows
    /// (`set`'s update refuses to go back).
    manual: AtomicU64,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            is_manual: AtomicBool::new(false),
            manual: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
        }
    }
}

impl Clock {
    /// Seconds: since the clock was made, or the last time `set`.
    pub fn now(&self) -> f64 {
        // Acquire: pairs with `set`'s Release, so a manual clock reads the time stored before
        // it was marked manual.
        if self.is_manual.load(Ordering::Acquire) {
            // Relaxed: the value itself orders nothing; `fetch_update` keeps it monotonic.
            f64::from_bits(self.manual.load(Ordering::Relaxed))
        } else {
            self.start.elapsed().as_secs_f64()
        }
    }

    /// Make the clock manual at `t` seconds (finite, and not before a manual time already
    /// set; refused with nothing changed otherwise).
    pub fn set(&self, t: f64) -> Result<()> {
        if !t.is_finite() || t < 0.0 {
            return Err(invalid(format!(
                "time must be a finite number >= 0, got {t}"
            )));
        }
        // Relaxed: a read-modify-write on one word (so racing `set`s never move it back);
        // the flag's Release publishes it.
        let set = self
            .manual
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                (t >= f64::from_bits(old)).then_some(t.to_bits())
            });
        match set {
            Ok(_) => {
                // Release: a reader that sees the flag sees a manual time stored before it.
                self.is_manual.store(true, Ordering::Release);
                Ok(())
            }
            Err(old) => Err(invalid(format!(
                "time must not go back: {t} is before {}",
                f64::from_bits(old)
            ))),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Clock;

    #[test]
    fn manual_time_only_moves_forward() {
        let c = Clock::default();
        assert!(c.now() >= 0.0);
        c.set(10.0).unwrap();
        assert_eq!(c.now(), 10.0);
        assert!(c.set(9.5).is_err());
        assert!(c.set(f64::NAN).is_err());
        assert!(c.set(-1.0).is_err());
        assert_eq!(c.now(), 10.0);
        c.set(10.0).unwrap();
        c.set(12.25).unwrap();
        assert_eq!(c.now(), 12.25);
    }
}
