//! pagedkv's compact snapshot part: one holder's (medium, group) blocks as a packed array of
//! keys, what a publisher sends for `pagedkv-snapshot-compact` (docs/events.md) instead of
//! vLLM payloads of one `BlockStored` an event.
//!
//! Why a form of its own: a snapshot of 1 M blocks as vLLM events is 1 M msgpack maps with
//! their token ids (about 90 MB), built and parsed event by event; packed, it is 8 MB of
//! integer hashes that encode and decode at memory speed and apply as one `BlockStored` of
//! many blocks. Parents and token ids are left out: the index keys blocks by their hashes
//! alone and a snapshot's blocks are all held, so no parent can be missing.
//!
//! Layout (little-endian):
//!
//! ```text
//! "PKVS" 1           magic and version (5 bytes; no msgpack payload starts with "P")
//! width  u8          bytes per key: 8 (vLLM's integer hashes) or the digest's width
//! group  u16
//! medium u8 flag     0: vLLM's unset medium (no name follows); 1: a name follows
//!        u16 length, then that many bytes of UTF-8
//! count  u32
//! keys   count x width bytes
//! ```
//!
//! A part that does not read exactly so (truncated, trailing bytes, another width than the
//! index's keys, a name that is not UTF-8) is refused whole.

use crate::error::RouterError;
use crate::event::Event;
use crate::key::BlockKey;
use crate::wire::Batch;

pub const MAGIC: &[u8; 5] = b"PKVS\x01";

/// Whether `payload` is a compact part (rather than a vLLM payload).
pub fn is_compact(payload: &[u8]) -> bool {
    payload.starts_with(&MAGIC[..4])
}

/// One part: `keys` held in `medium` and `group`.
pub fn encode<K: BlockKey>(medium: Option<&str>, group: u16, keys: &[K]) -> Vec<u8> {
    let mut out = header::<K>(medium, group, keys.len());
    for k in keys {
        k.pack(&mut out);
    }
    out
}

/// A part's bytes up to its keys (`count` of them to follow).
pub fn header<K: BlockKey>(medium: Option<&str>, group: u16, count: usize) -> Vec<u8> {
    let name = medium.map(str::as_bytes);
    let mut out = Vec::with_capacity(16 + name.map_or(0, <[u8]>::len) + count * K::PACKED);
    out.extend_from_slice(MAGIC);
    out.push(K::PACKED as u8);
    out.extend_from_slice(&group.to_le_bytes());
    match name {
        None => out.push(0),
        Some(n) => {
            out.push(1);
            let len = u16::try_from(n.len()).expect("a medium name under 64 KiB");
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(n);
        }
    }
    out.extend_from_slice(
        &u32::try_from(count)
            .expect("under 2**32 keys")
            .to_le_bytes(),
    );
    out
}

fn bad(what: &str) -> RouterError {
    RouterError::Payload(format!("compact snapshot part: {what}"))
}

struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], RouterError> {
        if self.b.len() < n {
            return Err(bad(&format!("truncated in {what}")));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn u16(&mut self, what: &str) -> Result<u16, RouterError> {
        Ok(u16::from_le_bytes(
            self.take(2, what)?.try_into().expect("2"),
        ))
    }
}

/// Decodes one part into a batch of one `BlockStored` (no parent).
pub fn decode<K: BlockKey>(payload: &[u8]) -> Result<Batch<'_, K>, RouterError> {
    let mut c = Cursor { b: payload };
    if c.take(5, "the magic")? != MAGIC {
        return Err(bad("not version 1 of the form"));
    }
    let width = usize::from(c.take(1, "the width")?[0]);
    if width != K::PACKED {
        return Err(RouterError::HashForm(format!(
            "a compact part of {width}-byte keys; this index holds {}-byte keys",
            K::PACKED
        )));
    }
    let group = c.u16("the group")?;
    let medium = match c.take(1, "the medium")?[0] {
        0 => None,
        1 => {
            let n = usize::from(c.u16("the medium's length")?);
            let name = c.take(n, "the medium's name")?;
            Some(std::str::from_utf8(name).map_err(|_| bad("a medium name not UTF-8"))?)
        }
        f => return Err(bad(&format!("medium flag {f}, not 0 or 1"))),
    };
    let count = u32::from_le_bytes(c.take(4, "the count")?.try_into().expect("4")) as usize;
    let keys = c.take(count.saturating_mul(width), "the keys")?;
    if !c.b.is_empty() {
        return Err(bad(&format!("{} trailing bytes", c.b.len())));
    }
    let hashes = keys.chunks_exact(width).map(K::unpack).collect();
    Ok(Batch {
        events: vec![Event::Stored {
            hashes,
            parent: None,
            medium,
            group,
        }],
        unknown: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_decodes_to_what_was_encoded() {
        let keys: Vec<u64> = vec![1, u64::MAX, 1 << 63];
        for medium in [None, Some("GPU"), Some("disk-ü")] {
            let p = encode(medium, 3, &keys);
            assert!(is_compact(&p));
            let b = decode::<u64>(&p).unwrap();
            assert_eq!(
                b.events,
                vec![Event::Stored {
                    hashes: keys.clone(),
                    parent: None,
                    medium,
                    group: 3
                }]
            );
        }
        let d: Vec<[u8; 16]> = vec![[7; 16]];
        let p = encode(Some("CPU"), 0, &d);
        assert_eq!(decode::<[u8; 16]>(&p).unwrap().events.len(), 1);
    }

    #[test]
    fn a_bad_part_is_refused() {
        let p = encode(Some("GPU"), 0, &[5u64, 6]);
        for cut in 0..p.len() {
            assert!(decode::<u64>(&p[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = p.clone();
        long.push(0);
        assert!(decode::<u64>(&long).is_err());
        assert!(matches!(
            decode::<[u8; 32]>(&p),
            Err(RouterError::HashForm(_))
        ));
        let mut flag = p.clone();
        flag[8] = 2;
        assert!(decode::<u64>(&flag).is_err());
        let mut version = p;
        version[4] = 2;
        assert!(decode::<u64>(&version).is_err());
    }
}
