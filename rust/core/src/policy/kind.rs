//! The kinds of KV-cache group and which leading tokens each no longer needs.

use crate::error::{invalid, Result};

/// One kind of layer (docs/semantics.md, "What each kind keeps").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention: every block of the sequence, always.
    Full,
    /// Sliding-window attention over the last `window` tokens.
    SlidingWindow { window: usize },
    /// Attention within the current `chunk`-token chunk (Llama 4's local layers).
    ChunkedLocal { chunk: usize },
    /// A recurrent state (Mamba, linear attention): only the block holding the latest state.
    State,
}

impl GroupKind {
    /// Parse the Python-side description (`KVCacheGroup`), validated against the block size.
    pub fn parse(
        kind: &str,
        window: Option<usize>,
        chunk: Option<usize>,
        block_size: usize,
    ) -> Result<Self> {
        let out = match (kind, window, chunk) {
            ("full", None, None) => Self::Full,
            ("state", None, None) => Self::State,
            ("sliding_window", Some(window), None) => Self::SlidingWindow { window },
            ("chunked_local", None, Some(chunk)) => Self::ChunkedLocal { chunk },
            ("full" | "state" | "sliding_window" | "chunked_local", _, _) => {
                return Err(invalid(format!(
                    "a {kind} group takes {}",
                    match kind {
                        "sliding_window" => "window= (and no chunk=)",
                        "chunked_local" => "chunk= (and no window=)",
                        _ => "neither window= nor chunk=",
                    }
                )))
            }
            _ => {
                return Err(invalid(format!(
                    "unknown group kind {kind:?}; expected 'full', 'sliding_window', \
                     'chunked_local' or 'state'"
                )))
            }
        };
        out.validate(block_size)?;
        Ok(out)
    }

    fn validate(self, block_size: usize) -> Result<()> {
        match self {
            Self::SlidingWindow { window } if window < block_size => Err(invalid(format!(
                "window {window} is smaller than a block ({block_size} tokens)"
            ))),
            Self::ChunkedLocal { chunk } if chunk == 0 || chunk % block_size != 0 => Err(invalid(
                format!("chunk {chunk} is not a multiple of the block size {block_size}"),
            )),
            _ => Ok(()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::ChunkedLocal { .. } => "chunked_local",
            Self::State => "state",
        }
    }

    /// Leading tokens no longer needed when the next token to compute is at `position`.
    pub fn skipped_tokens(self, position: usize) -> usize {
        match self {
            Self::Full => 0,
            Self::SlidingWindow { window } => position.saturating_sub(window.saturating_sub(1)),
            Self::ChunkedLocal { chunk } => position / chunk * chunk,
            Self::State => position.saturating_sub(1),
        }
    }

    /// Table entries `0 .. first_needed` are skipped (null) at `position`.
    pub fn first_needed(self, position: usize, block_size: usize) -> usize {
        self.skipped_tokens(position) / block_size
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn skipped_tokens_follow_each_kind() {
        let sw = GroupKind::SlidingWindow { window: 4 };
        // vLLM's examples (window 4, block 2): n=4 frees nothing, n=5 block 0, n=11 up to 3.
        assert_eq!(sw.first_needed(4, 2), 0);
        assert_eq!(sw.first_needed(5, 2), 1);
        assert_eq!(sw.first_needed(11, 2), 4);
        let cl = GroupKind::ChunkedLocal { chunk: 8 };
        assert_eq!(cl.skipped_tokens(7), 0);
        assert_eq!(cl.skipped_tokens(8), 8);
        assert_eq!(cl.skipped_tokens(17), 16);
        assert_eq!(GroupKind::State.skipped_tokens(0), 0);
        assert_eq!(GroupKind::State.first_needed(32, 16), 1);
        assert_eq!(GroupKind::Full.skipped_tokens(usize::MAX), 0);
        assert_eq!(sw.skipped_tokens(usize::MAX), usize::MAX - 3);
        assert_eq!(GroupKind::SlidingWindow { window: 1 }.skipped_tokens(7), 7);
    }

    #[test]
    fn parse_rejects_what_the_docs_reject() {
        assert!(GroupKind::parse("full", None, None, 16).is_ok());
        for (kind, w, c) in [
            ("sliding_window", Some(15), None),
            ("sliding_window", None, None),
            ("chunked_local", None, Some(24)),
            ("chunked_local", None, Some(0)),
            ("full", Some(32), None),
            ("mamba", None, None),
        ] {
            assert!(
                GroupKind::parse(kind, w, c, 16).is_err(),
                "{kind} {w:?} {c:?}"
            );
        }
    }
}
