//! A stream of lookups and touches over block keys, with each key's parent: what the curve
//! (`stack`) and the per-size replays (`policy_replay`) read. `MrcStream` records one from a
//! scheduled replay; `block_replay` builds one straight from a trace's hash ids.
//!
//! A key's parent is the key of the block before it in its sequence (`NO_PARENT` for a first
//! block): the prefix constraint of the optimal bound keeps a block only with its parent.

use crate::stack::Piece;

/// The parent of a sequence's first block (a 2**-64 chance of meeting a real key).
pub const NO_PARENT: u64 = u64::MAX;

#[derive(Clone, Debug, Default)]
pub struct Stream {
    /// Every piece's keys, in stream order.
    pub keys: Vec<u64>,
    /// `parents[i]`: the parent of `keys[i]`.
    pub parents: Vec<u64>,
    /// Where each piece ends in `keys`, and whether it is a lookup.
    pub pieces: Vec<Piece>,
}

impl Stream {
    /// Append a piece of `(key, parent)` pairs; a touch only if it holds a key.
    pub fn push(&mut self, new: impl IntoIterator<Item = (u64, u64)>, lookup: bool) {
        let before = self.keys.len();
        for (key, parent) in new {
            self.keys.push(key);
            self.parents.push(parent);
        }
        if lookup || self.keys.len() > before {
            self.pieces.push(Piece {
                end: self.keys.len(),
                lookup,
            });
        }
    }

    /// Lookups so far.
    pub fn lookups(&self) -> usize {
        self.pieces.iter().filter(|p| p.lookup).count()
    }
}

/// `(keys[i], its parent)` for `i` in `range`, the parent of `keys[0]` being `NO_PARENT`.
pub fn with_parents(
    keys: &[u64],
    range: std::ops::Range<usize>,
) -> impl DoubleEndedIterator<Item = (u64, u64)> + '_ {
    range.map(move |i| (keys[i], if i == 0 { NO_PARENT } else { keys[i - 1] }))
}
