//! Why the index refused a call. A refused call changed nothing (a medium name met in a
//! refused payload may stay interned: names are not state a lookup can see).

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouterError {
    /// The payload is not a vLLM `KVEventBatch` (garbage, truncated, wrong structure).
    #[error("bad KV event payload: {0}")]
    Payload(String),
    /// A hash of the other form, or a digest of another width, than the index holds.
    #[error("wrong block hash: {0}")]
    HashForm(String),
    /// More holders (engine x medium x group) than the index was built for.
    #[error("the index holds at most {0} holders (engine x medium x group); raise max_holders")]
    TooManyHolders(usize),
    /// More distinct medium names than the index interns.
    #[error("the index interns at most {0} medium names")]
    TooManyMedia(usize),
    /// A snapshot call out of order (no snapshot begun for this engine).
    #[error("{0}")]
    Snapshot(String),
}
