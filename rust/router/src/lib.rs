//! pagedkv-router: an exact KV-aware router index.
//!
//! Routers that place requests across serving engines keep an index of which KV blocks each
//! engine holds, fed by the engines' KV events (vLLM's wire format), and send a request where
//! the longest prefix of its blocks is cached. This crate is that index: per engine, medium
//! and group, the set of block hashes held, and for a request's hashes, each holder's number
//! of leading blocks held; exact (keys are compared whole: no false hits), with lookups from
//! any number of threads while events apply (docs/router.md).
//!
//! The parts, one file each: `key` (block keys and the maps' hasher), `msgpack` and `wire`
//! (vLLM's payloads decoded), `compact` (pagedkv's compact snapshot parts) and `held` (a
//! publisher's record of its blocks, written out as such parts), `event`, `slots` (holder slots: bits, liveness, generations),
//! `blocks` (the block map) and `table` (its hash table), `engine` (engines and their holders), `media` (medium names),
//! `index` (applying events, snapshots, removal), `replaced` (replaced holders awaiting their drop), `lookup` (prefix matches) and `word_read` (one word of holders read under its generation), `stats`;
//! `sync` (the atomics and locks loom replaces in `loom_models`).
//!
//! Memory: an entry of the block map per (block, word of 64 holders): 16 bytes and a control
//! byte for the integer form, in hash tables at most 7/8 full; and a set entry per (block,
//! holder) membership (8 bytes and a control byte), to drop a holder's blocks without a scan.
//! `Stats` reports both by the structure's own accounting (the tables' capacities).

mod blocks;
pub mod compact;
mod engine;
mod error;
mod event;
mod held;
mod index;
mod key;
mod lookup;
mod media;
mod msgpack;
mod pool;
mod replaced;
mod slots;
mod stats;
mod sync;
mod table;
pub mod wire;
mod word_read;

#[cfg(all(test, loom))]
mod loom_models;

pub use engine::EngineKey;
pub use error::RouterError;
pub use event::Event;
pub use held::HeldSet;
pub use index::{Applied, Config, RouterIndex};
pub use key::BlockKey;
pub use lookup::{Hit, RawHit};
pub use media::MAX_MEDIA;
pub use stats::Stats;
