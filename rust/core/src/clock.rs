//! The manager's clock, in seconds: what retention durations count against.
//!
//! Monotonic (`Instant`) until a caller sets the time (`set`), then manual for good: tests and
//! simulations drive retention expiry exactly, one tick at a time. The time it gives never goes
//! back: a manual time is refused below the last time set and, when the clock switches to
//! manual, below the last monotonic time it gave (a retention deadline counted from a time
//! it gave stays ahead of every later reading). Read under the policy lock by the priority
//! policy; set by any thread.

use crate::error::{invalid, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The bit of `Clock::word` that marks it manual: the sign bit, which no time (finite, `>=
/// 0`) has.
const MANUAL: u64 = 1 << 63;

pub struct Clock {
    /// When the clock was made; monotonic time is measured from it.
    start: Instant,
    /// The latest time the clock gave, as `f64` bits (`>= 0`, so their order as integers is
    /// the times' order), with `MANUAL` set once `set` made it manual (never cleared). One
    /// word, so that every reading and setting is one step in its modification order: that
    /// order alone keeps the time from going back (Relaxed is enough; the word publishes
    /// nothing else).
    word: AtomicU64,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            word: AtomicU64::new(0.0f64.to_bits()),
        }
    }
}

impl Clock {
    /// Seconds: since the clock was made (never less than a time it gave before), or the
    /// last time `set`.
    pub fn now(&self) -> f64 {
        let w = self.word.load(Ordering::Relaxed);
        if w & MANUAL != 0 {
            return f64::from_bits(w & !MANUAL);
        }
        let e = self.start.elapsed().as_secs_f64().to_bits();
        // Record the reading (a later switch to manual time is refused below it), unless a
        // later one was recorded meanwhile (then that one is the time) or the clock went
        // manual.
        match self
            .word
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                (old & MANUAL == 0 && old < e).then_some(e)
            }) {
            Ok(_) => f64::from_bits(e),
            Err(old) => f64::from_bits(old & !MANUAL),
        }
    }

    /// Make the clock manual at `t` seconds (finite, `>= 0`, and not before the last time
    /// the clock gave: the last one set, or before the first `set` the last monotonic
    /// reading; refused with nothing changed otherwise).
    pub fn set(&self, t: f64) -> Result<()> {
        if !t.is_finite() || t < 0.0 {
            return Err(invalid(format!(
                "time must be a finite number >= 0, got {t}"
            )));
        }
        // `-0.0 + 0.0` is `+0.0`: no time carries the sign bit.
        let t = t + 0.0;
        let set = self
            .word
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                (t >= f64::from_bits(old & !MANUAL)).then_some(t.to_bits() | MANUAL)
            });
        match set {
            Ok(_) => Ok(()),
            Err(old) if old & MANUAL != 0 => Err(invalid(format!(
                "time must not go back: {t} is before {}, the manual time set last",
                f64::from_bits(old & !MANUAL)
            ))),
            Err(old) => Err(invalid(format!(
                "time must not go back: {t} is before {}, the monotonic time the clock \
                 already gave (set_time may switch to manual time at or after it)",
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

    #[test]
    fn switching_to_manual_time_never_goes_back() {
        let c = Clock::default();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let seen = c.now();
        assert!(seen > 0.0);
        assert!(c.now() >= seen, "monotonic readings never go back");
        let err = c.set(seen / 2.0).unwrap_err().to_string();
        assert!(err.contains("monotonic"), "{err}");
        assert!(c.now() > seen / 2.0, "refused: still monotonic");
        let now = c.now();
        c.set(now).unwrap();
        assert_eq!(c.now(), now);
        c.set(-0.0 + now).unwrap();
        assert_eq!(c.now().to_bits() >> 63, 0);
    }

    #[test]
    fn a_clock_nobody_read_may_start_at_zero() {
        // Nothing counted against the monotonic time yet: any time is ahead of all it gave.
        let c = Clock::default();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.set(0.0).unwrap();
        assert_eq!(c.now(), 0.0);
        c.set(-0.0).unwrap();
        assert_eq!(c.now().to_bits(), 0);
    }
}
