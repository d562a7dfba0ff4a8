//! Retention with TensorRT-LLM's meaning (`allocate(retention=...)`), for the priority
//! policy: token ranges of the prompt, and one retention for the blocks decode adds.
//!
//! A sequence keeps its spec; when it lets go of blocks (free, truncate, swap-out) it gives
//! each of them its retention first, so the release that caches a block caches it with the
//! retention of the sequence that held it (the last one, if several had their own). A block
//! of a sequence without retention keeps what it had; a block that becomes FREE (released,
//! with or without digests, or withdrawn while pinned) returns to the default: its content
//! is gone (`block_pool`). A block takes the range that holds its first token, as
//! TensorRT-LLM's `getPerBlockRetentionPriorityDuration` does; a block whose first token is
//! past the prompt takes the decode retention.

use crate::error::{invalid, Result};
use crate::eviction::{EvictionKind, Retention, MAX_PRIORITY};
use crate::manager::BlockManager;
use crate::sequence::Sequence;

/// One token range: `[start, end)` (`end` None: to the prompt's end) and its retention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetentionRange {
    pub start: usize,
    pub end: Option<usize>,
    pub retention: Retention,
}

/// A sequence's retention: prompt ranges (sorted by start, non-overlapping, non-empty) and
/// the retention of the blocks past the prompt. Built only by `new`, which checks it.
#[derive(Debug, Clone, PartialEq)]
pub struct RetentionSpec {
    ranges: Vec<RetentionRange>,
    decode: Option<Retention>,
}

fn check_retention(r: &Retention, what: &str) -> Result<()> {
    if r.priority > MAX_PRIORITY {
        return Err(invalid(format!(
            "{what}: priority must be in 0..={MAX_PRIORITY}, got {}",
            r.priority
        )));
    }
    if let Some(d) = r.duration {
        if !(d.is_finite() && d >= 0.0) {
            return Err(invalid(format!(
                "{what}: duration_s must be a finite number >= 0, got {d}"
            )));
        }
    }
    Ok(())
}

impl RetentionSpec {
    /// Sorts the ranges by start; refuses empty or overlapping ones, priorities past
    /// `MAX_PRIORITY` and durations that are not finite and >= 0.
    pub fn new(mut ranges: Vec<RetentionRange>, decode: Option<Retention>) -> Result<Self> {
        ranges.sort_by_key(|r| r.start);
        for (i, r) in ranges.iter().enumerate() {
            let end = r.end.map_or("end".to_string(), |e| e.to_string());
            let what = format!("retention range {i} [{}, {end})", r.start);
            check_retention(&r.retention, &what)?;
            if r.end.is_some_and(|e| e <= r.start) {
                return Err(invalid(format!("{what} is empty")));
            }
            if let Some(next) = ranges.get(i + 1) {
                if r.end.is_none_or(|e| e > next.start) {
                    return Err(invalid(format!(
                        "{what} overlaps the range starting at {}",
                        next.start
                    )));
                }
            }
        }
        if let Some(d) = &decode {
            check_retention(d, "decode_retention")?;
        }
        Ok(Self { ranges, decode })
    }

    /// The retention of the block whose first token is `first`, in a sequence whose prompt
    /// has `prompt` tokens; None where no range (or no decode retention) applies.
    pub fn of_block(&self, first: usize, prompt: usize) -> Option<Retention> {
        if first >= prompt {
            return self.decode;
        }
        // The last range starting at or before `first`, if it reaches past it.
        let i = self.ranges.partition_point(|r| r.start <= first);
        let r = self.ranges.get(i.checked_sub(1)?)?;
        r.end.is_none_or(|e| first < e).then_some(r.retention)
    }
}

impl BlockManager {
    /// Refuse retention unless the manager evicts by priority (nothing else reads it), and
    /// with `groups=`, even one full-attention group (which runs the plain paths), as the
    /// reference refuses it: one rule for every `groups=`.
    pub(crate) fn check_retention_allowed(&self, spec: Option<&RetentionSpec>) -> Result<()> {
        if spec.is_some() && self.grouped {
            return Err(invalid(
                "retention with KV-cache groups (groups=) is not supported".to_string(),
            ));
        }
        if spec.is_some() && self.config().eviction != EvictionKind::Priority {
            return Err(invalid(format!(
                "retention needs eviction='priority', this manager evicts by {:?}",
                self.config().eviction.name()
            )));
        }
        Ok(())
    }

    /// Give `seq`'s blocks `from..from + count` (table positions) their retention, before
    /// the sequence lets go of them. Blocks without a digest are never cached: skipped.
    pub(crate) fn retain(&self, seq: &Sequence, from: usize, count: usize) {
        let Some((spec, prompt)) = seq.retention() else {
            return;
        };
        let bs = self.block_size();
        let end = (from + count).min(seq.blocks.len()).min(seq.digests.len());
        let blocks: Vec<(u32, Retention)> = (from..end)
            .filter_map(|i| {
                let r = spec.of_block(i * bs, *prompt)?;
                Some((seq.blocks[i], r))
            })
            .collect();
        self.gpu.set_retentions(&blocks);
    }

    /// Make the manager's clock manual at `t` seconds (retention durations count against
    /// it): from then on time moves only by `set_time`, never back.
    pub fn set_time(&self, t: f64) -> Result<()> {
        self.clock.set(t)
    }

    /// The manager's clock, in seconds.
    pub fn now(&self) -> f64 {
        self.clock.now()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn r(priority: u8, duration: Option<f64>) -> Retention {
        Retention { priority, duration }
    }

    fn range(start: usize, end: Option<usize>, p: u8) -> RetentionRange {
        RetentionRange {
            start,
            end,
            retention: r(p, None),
        }
    }

    #[test]
    fn a_block_takes_the_range_holding_its_first_token() {
        let spec = RetentionSpec::new(
            vec![range(10, None, 60), range(0, Some(6), 80)],
            Some(r(10, Some(1.0))),
        )
        .unwrap();
        // Block size 4, prompt 20: blocks start at 0, 4, 8, 12, 16; 20 is decode.
        let got: Vec<_> = [0, 4, 8, 12, 16, 20]
            .iter()
            .map(|&f| spec.of_block(f, 20).map(|x| x.priority))
            .collect();
        assert_eq!(
            got,
            [Some(80), Some(80), None, Some(60), Some(60), Some(10)]
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        let bad = [
            vec![range(4, Some(4), 50)],
            vec![range(0, Some(8), 50), range(4, None, 50)],
            vec![range(0, None, 50), range(4, None, 50)],
            vec![range(0, None, 101)],
        ];
        for ranges in bad {
            assert!(RetentionSpec::new(ranges, None).is_err());
        }
        assert!(RetentionSpec::new(vec![], Some(r(50, Some(f64::NAN)))).is_err());
        assert!(RetentionSpec::new(vec![], Some(r(50, Some(-1.0)))).is_err());
        assert!(RetentionSpec::new(vec![range(0, Some(4), 0), range(4, None, 100)], None).is_ok());
    }
}
