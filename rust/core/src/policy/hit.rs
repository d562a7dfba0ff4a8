//! The hybrid prefix hit: the longest prefix every group can serve (vLLM's coordinator).

use super::kind::GroupKind;

/// Where a sequence's next token to compute sits for a hit of `h` blocks: right after the
/// hit, or past tokens whose KV arrives from outside the cache (a connector's load). A
/// group that skips leading tokens needs only the hit blocks it reads from there: a state
/// group whose state at the loaded boundary arrives with the load needs none of the hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Tokens past the hit whose KV is loaded, not computed.
    pub loaded: usize,
    /// The position never passes the prompt's length.
    pub limit: usize,
}

impl Resume {
    /// The position for a hit of `h` blocks of `block_size` tokens.
    pub fn position(self, h: usize, block_size: usize) -> usize {
        let at = h * block_size;
        at.saturating_add(self.loaded).min(self.limit).max(at)
    }

    /// The first table entry group `kind` needs for a hit of `h` blocks (at most `h`).
    pub fn first_needed(self, kind: GroupKind, h: usize, block_size: usize) -> usize {
        kind.first_needed(self.position(h, block_size), block_size)
            .min(h)
    }
}

/// The largest `l <= cap` (in blocks) that every group can serve. `present(g, i)` says
/// whether group `g` has block `i` cached; it is asked at most once per (group, block).
///
/// Group `g` serves `l` when blocks `first_needed(p) .. l` are all present, `p` the position
/// the sequence resumes at (`resume`: `l * B`, or past loaded tokens). Full groups
/// need the whole prefix, so they are looked up once, left to right; every other group
/// then lowers `l` to the largest value it serves, in turn, until none lowers it (at most
/// `cap` rounds, since `l` only falls). Each group's answer depends only on `l`, so the
/// fixed point is the largest length all of them serve.
pub fn hybrid_hit(
    kinds: &[GroupKind],
    block_size: usize,
    cap: usize,
    resume: Resume,
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
                        let need = len - resume.first_needed(*kind, len, block_size);
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
        let resume = Resume {
            loaded: 0,
            limit: usize::MAX,
        };
        hybrid_hit(kinds, bs, cap, resume, |g, i| {
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

    #[test]
    fn a_load_past_the_hit_lowers_what_each_group_needs() {
        let t = true;
        let f = false;
        let st = GroupKind::State;
        let full = GroupKind::Full;
        let at = |loaded| Resume { loaded, limit: 24 };
        // Only block 0's state is cached: right after the hit both groups agree on 1 block.
        let cached: &[&[bool]] = &[&[t; 5], &[t, f, f, f, f]];
        let look = |g: usize, i: usize| cached[g][i];
        assert_eq!(hybrid_hit(&[full, st], 4, 5, at(0), look), 1);
        // Four tokens loaded past the hit bring the state at the end of the load: full
        // attention's 5 blocks serve.
        assert_eq!(hybrid_hit(&[full, st], 4, 5, at(4), look), 5);
        assert_eq!(at(4).first_needed(st, 5, 4), 5);
        // Fewer than a block loaded still resumes past the boundary: the state arrives.
        assert_eq!(hybrid_hit(&[full, st], 4, 5, at(1), look), 5);
        // The position never passes the prompt: 5 blocks + 8 loaded stop at 24.
        assert_eq!(at(8).position(5, 4), 24);
        // A window reads its last `window - 1` tokens before the position.
        let sw = GroupKind::SlidingWindow { window: 8 };
        assert_eq!(at(4).first_needed(sw, 4, 4), 3);
        assert_eq!(at(0).first_needed(sw, 4, 4), 2);
    }
}
