//! Draft slots a batch query covers past each sequence's scheduled tokens.
//!
//! Speculative decoding verifies drafts in the same forward pass as other sequences'
//! prefill chunks, so the slot mapping and the page table of one step take a lookahead per
//! sequence (0 for a prefill, the draft count for a decode). The slots themselves exist only
//! where a scheduling call reserved them (`allocate`/`extend`/`append` with `lookahead`); the
//! queries check each sequence's room and never take blocks.

use crate::error::{invalid, Result};

/// Draft slots per sequence of a batch: one count for all, or one count per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookahead<'a> {
    /// The same count for every sequence (0: no draft slots).
    All(usize),
    /// One count per sequence, in batch order (its length must be the batch's).
    Each(&'a [usize]),
}

impl Lookahead<'_> {
    /// The count of batch position `i` (in range: `check_len` passed).
    pub fn at(&self, i: usize) -> usize {
        match self {
            Lookahead::All(k) => *k,
            Lookahead::Each(ks) => ks[i],
        }
    }

    /// A cross-argument check: a per-sequence lookahead has one entry per sequence.
    pub(crate) fn check_len(&self, n: usize) -> Result<()> {
        match self {
            Lookahead::Each(ks) if ks.len() != n => Err(invalid(format!(
                "seq_ids has {n} entries but lookahead has {}",
                ks.len()
            ))),
            _ => Ok(()),
        }
    }
}

impl From<usize> for Lookahead<'_> {
    fn from(k: usize) -> Self {
        Lookahead::All(k)
    }
}

impl<'a> From<&'a [usize]> for Lookahead<'a> {
    fn from(ks: &'a [usize]) -> Self {
        Lookahead::Each(ks)
    }
}

impl<'a> From<&'a Vec<usize>> for Lookahead<'a> {
    fn from(ks: &'a Vec<usize>) -> Self {
        Lookahead::Each(ks)
    }
}
