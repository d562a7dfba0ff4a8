//! vLLM's KV event payloads (`vllm/distributed/kv_events.py`, 0.32 to 0.34; pagedkv's
//! `kv_events.wire` writes the same bytes), decoded straight into [`Event`]s.
//!
//! A payload is the msgpack array `[ts, [events], data_parallel_rank]` (the rank may be
//! missing). An event is either a map tagged by `"type"` (vLLM's default: the fields by name,
//! the unset optional ones left out) or the older positional array `["BlockStored",
//! block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//! extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes, medium, group_idx, ...]`,
//! `["AllBlocksCleared"]`. Fields the index does not need are skipped whatever they hold, so
//! fields a later vLLM adds are no error.
//!
//! A hash is an integer (0 to 2^64 - 1; a negative one, as vLLM's old Python `hash()` values
//! were, is taken as its 64-bit two's complement) or a byte string; which one is accepted, and
//! of what width, is the index's key form.
//!
//! Errors: a payload that is not such an array (garbage, truncated, trailing bytes, a field of
//! the wrong type) is refused whole. An event whose type is none of the three is skipped and
//! counted (`Batch::unknown`), so that an event type a later vLLM adds does not cost the rest
//! of its batch.

use crate::error::RouterError;
use crate::event::Event;
use crate::key::BlockKey;
use crate::msgpack::{Int, Reader};

/// A decoded payload.
#[derive(Debug, Default)]
pub struct Batch<'a, K> {
    pub events: Vec<Event<'a, K>>,
    /// Events of a type other than the three, skipped.
    pub unknown: usize,
}

/// Decodes one payload. Nothing is applied: an index applies the result only when the whole
/// payload decoded.
pub fn decode<K: BlockKey>(payload: &[u8]) -> Result<Batch<'_, K>, RouterError> {
    let mut r = Reader::new(payload);
    let n = r.array()?;
    if n < 2 {
        return Err(
            r.err("a KVEventBatch is [ts, events, data_parallel_rank]; this array is shorter")
        );
    }
    r.skip()?; // ts
    let count = r.array()?;
    // Bounded by the payload: every event takes at least one byte.
    let mut batch = Batch {
        events: Vec::with_capacity(count.min(payload.len())),
        unknown: 0,
    };
    for _ in 0..count {
        match if r.is_map()? {
            map_event(&mut r)?
        } else {
            array_event(&mut r)?
        } {
            Some(e) => batch.events.push(e),
            None => batch.unknown += 1,
        }
    }
    for _ in 2..n {
        r.skip()?; // data_parallel_rank, and anything after it
    }
    if !r.at_end() {
        return Err(r.err("trailing bytes after the KVEventBatch"));
    }
    Ok(batch)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Other,
}

fn tag(s: &[u8]) -> Tag {
    match s {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Other,
    }
}

struct Fields<'a, K> {
    hashes: Option<Vec<K>>,
    parent: Option<K>,
    medium: Option<&'a str>,
    group: u16,
}

impl<K> Default for Fields<'_, K> {
    fn default() -> Self {
        Self {
            hashes: None,
            parent: None,
            medium: None,
            group: 0,
        }
    }
}

fn build<'a, K>(
    r: &Reader<'a>,
    t: Tag,
    f: Fields<'a, K>,
) -> Result<Option<Event<'a, K>>, RouterError> {
    let hashes = |f: Option<Vec<K>>, what: &str| {
        f.ok_or_else(|| r.err(&format!("a {what} event without block_hashes")))
    };
    Ok(match t {
        Tag::Stored => Some(Event::Stored {
            hashes: hashes(f.hashes, "BlockStored")?,
            parent: f.parent,
            medium: f.medium,
            group: f.group,
        }),
        Tag::Removed => Some(Event::Removed {
            hashes: hashes(f.hashes, "BlockRemoved")?,
            medium: f.medium,
            group: f.group,
        }),
        Tag::Cleared => Some(Event::Cleared),
        Tag::Other => None,
    })
}

fn map_event<'a, K: BlockKey>(r: &mut Reader<'a>) -> Result<Option<Event<'a, K>>, RouterError> {
    let n = r.map()?;
    let mut t = None;
    let mut f = Fields::default();
    for _ in 0..n {
        match r.raw_str()? {
            b"type" => t = Some(tag(r.raw_str()?)),
            b"block_hashes" => f.hashes = Some(hashes(r)?),
            b"parent_block_hash" => f.parent = opt_hash(r)?,
            b"medium" => f.medium = opt_str(r)?,
            b"group_idx" => f.group = opt_group(r)?,
            _ => r.skip()?,
        }
    }
    let t = t.ok_or_else(|| r.err("an event map without a \"type\""))?;
    build(r, t, f)
}

fn array_event<'a, K: BlockKey>(r: &mut Reader<'a>) -> Result<Option<Event<'a, K>>, RouterError> {
    let n = r.array()?;
    if n == 0 {
        return Err(r.err("an empty event array (no type)"));
    }
    let t = tag(r.raw_str()?);
    let mut f = Fields::default();
    for i in 1..n {
        match (t, i) {
            (Tag::Stored | Tag::Removed, 1) => f.hashes = Some(hashes(r)?),
            (Tag::Stored, 2) => f.parent = opt_hash(r)?,
            (Tag::Stored, 6) | (Tag::Removed, 2) => f.medium = opt_str(r)?,
            (Tag::Stored, 9) | (Tag::Removed, 3) => f.group = opt_group(r)?,
            _ => r.skip()?,
        }
    }
    build(r, t, f)
}

fn opt_str<'a>(r: &mut Reader<'a>) -> Result<Option<&'a str>, RouterError> {
    if r.nil()? {
        return Ok(None);
    }
    r.str().map(Some)
}

fn opt_group(r: &mut Reader<'_>) -> Result<u16, RouterError> {
    if r.nil()? {
        return Ok(0);
    }
    Ok(r.uint("group_idx", u64::from(u16::MAX))? as u16)
}

fn opt_hash<K: BlockKey>(r: &mut Reader<'_>) -> Result<Option<K>, RouterError> {
    if r.nil()? {
        return Ok(None);
    }
    hash(r).map(Some)
}

fn hashes<K: BlockKey>(r: &mut Reader<'_>) -> Result<Vec<K>, RouterError> {
    let n = r.array()?;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

/// What the index expects, for error messages.
pub fn form_name<K: BlockKey>() -> String {
    if K::WIDTH == 0 {
        "integer hashes".to_owned()
    } else {
        format!("{}-byte digests", K::WIDTH)
    }
}

fn hash<K: BlockKey>(r: &mut Reader<'_>) -> Result<K, RouterError> {
    if let Some(i) = r.int()? {
        let v = match i {
            Int::U(v) => v,
            Int::I(v) => v as u64, // two's complement (module docs)
        };
        return K::from_int(v).ok_or_else(|| {
            RouterError::HashForm(format!(
                "an integer block hash in an index of {}",
                form_name::<K>()
            ))
        });
    }
    if let Some(b) = r.bin()? {
        return K::from_bytes(b).ok_or_else(|| {
            RouterError::HashForm(format!(
                "a {}-byte block hash in an index of {}",
                b.len(),
                form_name::<K>()
            ))
        });
    }
    Err(r.err(&format!(
        "a block hash must be an integer or bytes, found marker 0x{:02x}",
        r.peek()?
    )))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny msgpack writer for tests.
    #[derive(Default)]
    pub struct W(pub Vec<u8>);

    impl W {
        pub fn arr(&mut self, n: usize) -> &mut Self {
            assert!(n < 16);
            self.0.push(0x90 | n as u8);
            self
        }
        pub fn map(&mut self, n: usize) -> &mut Self {
            assert!(n < 16);
            self.0.push(0x80 | n as u8);
            self
        }
        pub fn s(&mut self, s: &str) -> &mut Self {
            assert!(s.len() < 32);
            self.0.push(0xa0 | s.len() as u8);
            self.0.extend_from_slice(s.as_bytes());
            self
        }
        pub fn u(&mut self, v: u64) -> &mut Self {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        pub fn bin(&mut self, b: &[u8]) -> &mut Self {
            self.0.push(0xc4);
            self.0.push(b.len() as u8);
            self.0.extend_from_slice(b);
            self
        }
        pub fn nil(&mut self) -> &mut Self {
            self.0.push(0xc0);
            self
        }
        pub fn f64(&mut self, v: f64) -> &mut Self {
            self.0.push(0xcb);
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
    }

    fn stored_map(w: &mut W, hashes: &[u64], parent: Option<u64>, group: Option<u64>) {
        w.map(if group.is_some() { 5 } else { 4 })
            .s("type")
            .s("BlockStored");
        w.s("block_hashes").arr(hashes.len());
        for &h in hashes {
            w.u(h);
        }
        w.s("parent_block_hash");
        match parent {
            Some(p) => w.u(p),
            None => w.nil(),
        };
        w.s("medium").s("GPU");
        if let Some(g) = group {
            w.s("group_idx").u(g);
        }
    }

    #[test]
    fn map_and_array_forms() {
        let mut w = W::default();
        w.arr(3).f64(1.5).arr(4);
        stored_map(&mut w, &[1, 2], None, Some(1));
        w.arr(4).s("BlockRemoved").arr(1).u(2).s("CPU").u(3);
        w.map(2).s("type").s("Mystery").s("x").u(1);
        w.arr(1).s("AllBlocksCleared");
        w.u(0);
        let b = decode::<u64>(&w.0).unwrap();
        assert_eq!(b.unknown, 1);
        assert_eq!(
            b.events,
            vec![
                Event::Stored {
                    hashes: vec![1, 2],
                    parent: None,
                    medium: Some("GPU"),
                    group: 1
                },
                Event::Removed {
                    hashes: vec![2],
                    medium: Some("CPU"),
                    group: 3
                },
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn wrong_forms_and_garbage_are_refused() {
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).map(2).s("type").s("BlockRemoved");
        w.s("block_hashes").arr(1).bin(&[1; 16]);
        assert!(matches!(decode::<u64>(&w.0), Err(RouterError::HashForm(_))));
        assert!(matches!(
            decode::<[u8; 32]>(&w.0),
            Err(RouterError::HashForm(_))
        ));
        assert!(decode::<[u8; 16]>(&w.0).is_ok());
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1);
        stored_map(&mut w, &[1], Some(9), None);
        assert!(matches!(
            decode::<[u8; 16]>(&w.0),
            Err(RouterError::HashForm(_))
        ));
        let ok = w.0.clone();
        assert!(decode::<u64>(&ok).is_ok());
        for cut in 0..ok.len() {
            assert!(decode::<u64>(&ok[..cut]).is_err(), "a payload cut at {cut}");
        }
        let mut trailing = ok.clone();
        trailing.push(0);
        assert!(decode::<u64>(&trailing).is_err());
        assert!(decode::<u64>(b"garbage").is_err());
        // A map event with no type, and a BlockStored with no hashes.
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).map(1).s("medium").s("GPU");
        assert!(decode::<u64>(&w.0).is_err());
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1).map(1).s("type").s("BlockStored");
        assert!(decode::<u64>(&w.0).is_err());
        // group_idx beyond u16.
        let mut w = W::default();
        w.arr(2).f64(0.0).arr(1);
        stored_map(&mut w, &[1], None, Some(70_000));
        assert!(decode::<u64>(&w.0).is_err());
    }
}
