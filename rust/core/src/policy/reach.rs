//! Sparse prefix-cache retention for sliding-window groups (vLLM's
//! `prefix_cache_retention_interval`, `SlidingWindowManager.reachable_block_mask`): a window
//! group caches only the full blocks a later hit can read, the `need` blocks before a
//! position where a hit can end, and leaves the others unhashed (they are freed as
//! uncached blocks and never evict a reachable one). Full, chunked-local and state groups
//! cache every full block whatever the setting (docs/semantics.md, "Window retention").
//!
//! A hit ends at a block boundary, and a window group serves it from the `cdiv(window - 1,
//! block)` blocks before it. Which boundaries count (`interval`):
//! - `None`: every one (dense, every full block is cached);
//! - `Some(0)`: only the sequence's `reachable` positions (its prompt less one token, where a
//!   resend of the prompt resumes, and a shared-prefix junction its lookup reported);
//! - `Some(r)`, a multiple of the block size: those, and every `r`-token boundary.

use super::kind::GroupKind;
use crate::error::{invalid, Result};

/// Check `interval` against the layout, as vLLM's coordinator does: `None` always; with no
/// sliding-window group only 0 (it changes nothing there); otherwise a multiple of the
/// block size. pagedkv keeps state groups dense, so a positive interval needs a window.
pub fn check_interval(
    kinds: &[GroupKind],
    block_size: usize,
    interval: Option<usize>,
) -> Result<()> {
    let Some(r) = interval else { return Ok(()) };
    let windows = kinds
        .iter()
        .any(|k| matches!(k, GroupKind::SlidingWindow { .. }));
    if !windows {
        if r == 0 {
            return Ok(());
        }
        return Err(invalid(format!(
            "prefix_cache_retention_interval {r} applies to sliding-window groups and this \
             layout has none: give 0 or None"
        )));
    }
    if r % block_size != 0 {
        return Err(invalid(format!(
            "prefix_cache_retention_interval {r} must be 0, None or a multiple of the block \
             size {block_size}"
        )));
    }
    Ok(())
}

/// Whether group `kind` caches its full block `i` (of `block_size` tokens) under `interval`,
/// for a sequence whose hits can resume at the token positions `reachable`.
pub fn caches_block(
    kind: GroupKind,
    i: usize,
    block_size: usize,
    interval: Option<usize>,
    reachable: &[usize],
) -> bool {
    let (GroupKind::SlidingWindow { window }, Some(r)) = (kind, interval) else {
        return true;
    };
    // Blocks a hit ending at a boundary reads (vLLM's `_contiguous_blocks_for_hit`).
    let need = window.saturating_sub(1).div_ceil(block_size);
    // A boundary at block `end` keeps blocks `end - need .. end`.
    let tail = |end: usize| i < end && i + need >= end;
    if r > 0 {
        let per = r / block_size;
        if need >= per || i % per >= per - need {
            return true;
        }
    }
    reachable.iter().any(|&p| tail(p / block_size))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const SW: GroupKind = GroupKind::SlidingWindow { window: 64 };

    fn kept(interval: Option<usize>, reachable: &[usize], blocks: usize) -> Vec<usize> {
        (0..blocks)
            .filter(|&i| caches_block(SW, i, 32, interval, reachable))
            .collect()
    }

    #[test]
    fn only_the_window_tail_before_each_reachable_position_is_cached() {
        // Window 64, blocks of 32: a hit reads the 2 blocks before its boundary.
        assert_eq!(kept(Some(0), &[199], 8), vec![4, 5]); // 199 -> boundary 192 = block 6
        assert_eq!(kept(Some(0), &[199, 96], 8), vec![1, 2, 4, 5]);
        // A position inside a block counts from the boundary below it.
        assert_eq!(kept(Some(0), &[127], 8), vec![1, 2]);
        assert_eq!(kept(Some(0), &[32], 8), vec![0]);
        assert_eq!(kept(Some(0), &[0, 31], 8), Vec::<usize>::new());
        assert_eq!(kept(None, &[], 4), vec![0, 1, 2, 3]);
    }

    #[test]
    fn an_interval_adds_the_tail_of_every_segment() {
        // 128-token segments (4 blocks): blocks 2, 3 of each, plus the reachable tails.
        assert_eq!(kept(Some(128), &[], 12), vec![2, 3, 6, 7, 10, 11]);
        assert_eq!(kept(Some(128), &[160], 12), vec![2, 3, 4, 6, 7, 10, 11]);
        // A segment no longer than the tail: every block.
        assert_eq!(kept(Some(64), &[], 5), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn other_kinds_cache_every_block() {
        for kind in [
            GroupKind::Full,
            GroupKind::State,
            GroupKind::ChunkedLocal { chunk: 64 },
        ] {
            assert!((0..8).all(|i| caches_block(kind, i, 32, Some(0), &[])));
        }
    }

    #[test]
    fn the_interval_is_checked_against_the_layout() {
        let full = GroupKind::Full;
        assert!(check_interval(&[full], 32, None).is_ok());
        assert!(check_interval(&[full], 32, Some(0)).is_ok());
        assert!(check_interval(&[full, GroupKind::State], 32, Some(0)).is_ok());
        let err = check_interval(&[full], 32, Some(64)).unwrap_err();
        assert!(err.to_string().contains("has none"), "{err}");
        let err = check_interval(&[full, GroupKind::State], 32, Some(64)).unwrap_err();
        assert!(err.to_string().contains("has none"), "{err}");
        assert!(check_interval(&[full, SW], 32, Some(64)).is_ok());
        let err = check_interval(&[full, SW], 32, Some(48)).unwrap_err();
        assert!(
            err.to_string().contains("multiple of the block size 32"),
            "{err}"
        );
    }
}
