//! The hybrid prefix hit: the longest prefix every group can serve (vLLM's coordinator).

use super::kind::GroupKind;

/// The largest `l <= cap` (in blocks) that every group can serve. `present(g, i)` says
/// whether group `g` has block `i` cached; it is asked at most once per (group, block).
///
/// Group `g` serves `l` when blocks `first_needed(l * B) .. l` are all present. Full groups
/// need the whole prefix, so they are looked up once, left to right; every other group
/// then lowers `l` to the largest value it serves, in turn, until none lowers it (at most
/// `cap` rounds, since `l` only falls). Each group's answer depends only on `l`, so the
/// fixed point is the largest length all of them serve.
pub fn hybrid_hit(
    kinds: &[GroupKind],
    block_size: usize,
    cap: usize,
    mut present: impl FnMut(usize, usize) -> bool,
) -> usize {
    let mut l = cap;
    for (g, kind) in kinds.iter().enumerate() {
        if *kind == GroupKind::Full {
            l = (0..l).find(|&i| !present(g, i)).unwrap_or(l);
        }
    }
    // run[g][i]: how many consecutive present blocks end at block i (for the others).
    let runs: Vec<Option<Vec<usize>>> = kinds
        .iter()
        .enumerate()
        .map(|(g, kind)| {
            (*kind != GroupKind::Full).then(|| {
                let mut run = Vec::with_capacity(l);
                for i in 0..l {
                    let before = if i == 0 { 0 } else { run[i - 1] };
                    run.push(if present(g, i) { before + 1 } else { 0 });
                }
                run
            })
        })
        .collect();
    loop {
        let before = l;
        for (kind, run) in kinds.iter().zip(&runs) {
            if let Some(run) = run {
                l = (0..=l)
                    .rev()
                    .find(|&len| {
                        let need = len - kind.first_needed(len * block_size, block_size).min(len);
                        need == 0 || run[len - 1] >= need
                    })
                    .unwrap_or(0);
            }
        }
        if l == before {
            return l;
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn hit(kinds: &[GroupKind], bs: usize, cap: usize, cached: &[&[bool]]) -> usize {
        hybrid_hit(kinds, bs, cap, |g, i| {
            cached[g].get(i).copied().unwrap_or(false)
        })
    }

    #[test]
    fn sliding_window_needs_only_the_window() {
        let sw = GroupKind::SlidingWindow { window: 4 };
        // vLLM's finder example (window 4, block 2): the hit ends after the last run of two.
        let t = true;
        let f = false;
        let cached: &[bool] = &[t, t, f, t, f, f, t, t, f, f, f];
        assert_eq!(hit(&[sw], 2, 11, &[cached]), 8);
        assert_eq!(hit(&[sw], 2, 1, &[&[t]]), 1);
        assert_eq!(hit(&[sw], 2, 3, &[&[f, f, f]]), 0);
    }

    #[test]
    fn full_and_window_meet_at_the_longest_common_length() {
        let full = GroupKind::Full;
        let sw = GroupKind::SlidingWindow { window: 32 };
        let t = true;
        let f = false;
        // vLLM's hybrid prefill test: 3 cached blocks; the window group lost block 0.
        assert_eq!(hit(&[full, sw], 16, 3, &[&[t, t, t], &[f, t, t]]), 3);
        assert_eq!(hit(&[full, sw], 16, 3, &[&[f, t, t], &[t, t, t]]), 0);
        // A hole inside the window lowers the hit to where the window is whole again.
        assert_eq!(hit(&[full, sw], 16, 5, &[&[t; 5], &[t, t, f, t, f]]), 2);
    }

    #[test]
    fn state_needs_the_block_at_the_boundary_and_chunks_their_own_blocks() {
        let t = true;
        let f = false;
        let st = GroupKind::State;
        assert_eq!(
            hit(&[GroupKind::Full, st], 4, 4, &[&[t; 4], &[f, t, f, f]]),
            2
        );
        assert_eq!(hit(&[st], 4, 4, &[&[f, f, f, f]]), 0);
        let cl = GroupKind::ChunkedLocal { chunk: 8 };
        // At a chunk boundary the chunked group needs nothing; inside, its chunk's blocks.
        assert_eq!(hit(&[cl], 4, 3, &[&[f, f, f]]), 2);
        assert_eq!(hit(&[cl], 4, 4, &[&[f, f, f, f]]), 4);
        assert_eq!(hit(&[cl], 4, 3, &[&[f, f, t]]), 3);
        assert_eq!(hit(&[GroupKind::Full, cl], 4, 3, &[&[t; 4], &[f; 4]]), 2);
        assert_eq!(
            hit(&[GroupKind::Full, cl], 4, 4, &[&[t, t, t, f], &[f; 4]]),
            2
        );
    }
}
