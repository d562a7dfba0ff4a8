//! A pure cache replay of a trace given as hash ids, at block granularity: no scheduler, no
//! tokens. Each request in turn looks up its prompt's full blocks (all but a last block that
//! would leave no token to compute, as the manager caps a hit) and then touches them tail
//! first (the manager's release order: the head ends the most recent). Nothing runs at the same
//! time, nothing is pinned, nothing is preempted: the model the other sizing tools replay.
//!
//! Ids name a block of `id_tokens` tokens with its prefix (Mooncake's 512-token ids; Bailian's
//! 16-token ids once chained). A block of `block_size` tokens is keyed from the ids it covers,
//! chained like the token-content keys of `block_keys` (equal keys exactly where the prompts
//! share that prefix), so no token is ever built: with `block_size` dividing `id_tokens` each
//! id stands for `id_tokens / block_size` blocks (a partial last id for its full ones), with
//! `id_tokens` dividing `block_size` each block stands for `block_size / id_tokens` ids.

use crate::block_keys::{finish, step};
use crate::stream::{with_parents, Stream};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReplayError {
    #[error(
        "block_size {block_size} and the trace's {id_tokens} tokens per id: one must divide \
         the other"
    )]
    Granularity { block_size: usize, id_tokens: usize },
    #[error("request {request}: {length} prompt tokens but {ids} ids of {id_tokens} tokens")]
    Length {
        request: usize,
        length: usize,
        ids: usize,
        id_tokens: usize,
    },
    #[error("{0}")]
    Shape(String),
}

/// The requests' ids, flat: request `r` holds `ids[offsets[r]..offsets[r + 1]]`, has
/// `lengths[r]` prompt tokens and chain root `roots[r]` (its salt and LoRA id).
pub struct TraceIds<'a> {
    pub ids: &'a [u64],
    pub offsets: &'a [usize],
    pub lengths: &'a [usize],
    pub roots: &'a [u64],
    pub id_tokens: usize,
}

/// The content word of one block: the ids it covers, and which part of its id it is.
fn content(ids: &[u64], part: u64) -> u64 {
    ids.iter().fold(
        finish(part.wrapping_add(0x5851_F42D_4C95_7F2D)),
        |acc, &id| finish(acc ^ finish(id.wrapping_add(1))),
    )
}

/// The stream of a pure cache replay of `trace` in blocks of `block_size` tokens.
pub fn block_stream(trace: &TraceIds<'_>, block_size: usize) -> Result<Stream, ReplayError> {
    let t = trace.id_tokens;
    if block_size == 0 || t == 0 || (t % block_size != 0 && block_size % t != 0) {
        return Err(ReplayError::Granularity {
            block_size,
            id_tokens: t,
        });
    }
    let requests = trace.lengths.len();
    if trace.offsets.len() != requests + 1 || trace.roots.len() != requests {
        return Err(ReplayError::Shape(format!(
            "{requests} lengths need {} offsets and {requests} roots, got {} and {}",
            requests + 1,
            trace.offsets.len(),
            trace.roots.len()
        )));
    }
    if trace.offsets.windows(2).any(|w| w[0] > w[1])
        || trace.offsets.last().is_some_and(|&e| e > trace.ids.len())
    {
        return Err(ReplayError::Shape(
            "offsets must rise and end within the ids".into(),
        ));
    }
    let mut stream = Stream::default();
    let mut keys = Vec::new();
    for r in 0..requests {
        let ids = &trace.ids[trace.offsets[r]..trace.offsets[r + 1]];
        let n = trace.lengths[r];
        if n > ids.len() * t {
            return Err(ReplayError::Length {
                request: r,
                length: n,
                ids: ids.len(),
                id_tokens: t,
            });
        }
        keys.clear();
        let mut state = trace.roots[r];
        for k in 0..n / block_size {
            let c = if block_size <= t {
                let per = t / block_size;
                content(&ids[k / per..k / per + 1], (k % per) as u64)
            } else {
                let per = block_size / t;
                content(&ids[k * per..(k + 1) * per], 0)
            };
            let (key, raw) = step(state, c);
            keys.push(key);
            state = raw;
        }
        let capped = n.saturating_sub(1) / block_size;
        stream.push(with_parents(&keys, 0..capped), true);
        stream.push(with_parents(&keys, 0..keys.len()).rev(), false);
    }
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_of(reqs: &[(&[u64], usize)], id_tokens: usize, bs: usize) -> Stream {
        let mut ids = Vec::new();
        let mut offsets = vec![0];
        let mut lengths = Vec::new();
        for (r, n) in reqs {
            ids.extend_from_slice(r);
            offsets.push(ids.len());
            lengths.push(*n);
        }
        let roots = vec![7; reqs.len()];
        let trace = TraceIds {
            ids: &ids,
            offsets: &offsets,
            lengths: &lengths,
            roots: &roots,
            id_tokens,
        };
        block_stream(&trace, bs).expect("valid")
    }

    #[test]
    fn full_blocks_are_looked_up_capped_and_touched_tail_first() {
        // 3 ids of 4 tokens, 10 tokens: 2 full blocks of 4; the lookup covers both (9 / 4).
        let s = stream_of(&[(&[1, 2, 3], 10), (&[1, 2], 8)], 4, 4);
        assert_eq!(s.pieces.len(), 4);
        let a = &s.keys[0..2];
        assert_eq!(&s.keys[2..4], &[a[1], a[0]]); // touched tail first
                                                  // The second prompt is exactly two blocks: its lookup stops before the last one.
        assert_eq!(s.pieces[2].end - s.pieces[1].end, 1);
        assert_eq!(s.keys[4], a[0]);
        assert_eq!(&s.keys[5..7], &[a[1], a[0]]); // equal prefixes, equal keys
        assert_eq!(s.parents[2], a[0]); // the tail's parent is the head
    }

    #[test]
    fn smaller_blocks_split_ids_and_a_partial_id_keeps_its_full_blocks() {
        // Ids of 4 tokens in blocks of 2: a 6-token prompt of ids [5, 6] has 3 full blocks,
        // the first two those of a prompt [5] alone.
        let s = stream_of(&[(&[5, 6], 6), (&[5], 4)], 4, 2);
        let first: Vec<u64> = s.keys[2..5].iter().rev().copied().collect(); // its touch
        assert_eq!(first.len(), 3);
        let second: Vec<u64> = s.keys[6..8].iter().rev().copied().collect();
        assert_eq!(second, first[..2]);
        assert_ne!(first[0], first[1]); // the two halves of one id differ
    }

    #[test]
    fn larger_blocks_join_ids() {
        // Blocks of 8 over ids of 4: [1, 2, 3] with 12 tokens has one full block; a prompt
        // [1, 2] of 8 tokens shares it; [1, 9] does not.
        let s = stream_of(&[(&[1, 2, 3], 12), (&[1, 2], 8), (&[1, 9], 8)], 4, 8);
        let touched: Vec<u64> = s
            .pieces
            .iter()
            .scan(0, |start, p| {
                let r = (*start, p.end, p.lookup);
                *start = p.end;
                Some(r)
            })
            .filter(|r| !r.2)
            .map(|r| s.keys[r.0])
            .collect();
        assert_eq!(touched[0], touched[1]);
        assert_ne!(touched[0], touched[2]);
    }

    #[test]
    fn bad_input_is_refused() {
        let trace = TraceIds {
            ids: &[1],
            offsets: &[0, 1],
            lengths: &[5],
            roots: &[0],
            id_tokens: 4,
        };
        assert!(matches!(
            block_stream(&trace, 4),
            Err(ReplayError::Length { .. })
        ));
        assert!(matches!(
            block_stream(&trace, 3),
            Err(ReplayError::Granularity { .. })
        ));
    }
}
