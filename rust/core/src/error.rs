//! Errors for bad input. Running out of blocks is not an error: calls return `None`.

/// Why a call was refused. Every refused call changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("unknown sequence id {0}")]
    UnknownSequence(u64),
    #[error("sequence id {0} already exists")]
    DuplicateSequence(u64),
    #[error("sequence {0} is swapped out")]
    Swapped(u64),
    #[error("sequence {0} is not swapped out")]
    NotSwapped(u64),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("block {block} already has {limit} holders, the most a refcount can count")]
    RefcountOverflow { block: u32, limit: u32 },
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// Only in non-blocking mode (`crate::nonblocking`): the call would have waited for a
    /// lock and changed nothing; call it again in blocking mode.
    #[error("the call would block")]
    WouldBlock,
    /// An internal invariant failed mid-operation (a bug): the manager refuses every
    /// further mutating call, since its state may be inconsistent.
    #[error("the block manager is broken and refuses changes: {0}")]
    Broken(String),
    /// The bounded KV event queue overflowed: `drain_events` refuses until a snapshot
    /// (`kv_event_snapshot`) starts the consumer again.
    #[error(
        "the KV event queue overflowed its capacity of {capacity} events and {dropped} events \
         were not delivered; take kv_event_snapshot() to start again from the cached set"
    )]
    EventsOverflowed { capacity: usize, dropped: u64 },
    #[error("invariant violated: {0}")]
    Invariant(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// In audits: return `Error::Invariant` naming the violation unless the condition holds.
macro_rules! ensure_invariant {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::Invariant(format!($($msg)+)));
        }
    };
}
pub(crate) use ensure_invariant;
