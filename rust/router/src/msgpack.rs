//! A minimal msgpack reader: the subset vLLM's KV event payloads use, and a skip for the
//! rest. It borrows from the payload (strings and byte strings are slices of it) and never
//! allocates; every read checks the bounds and names what it found at which offset.

use crate::error::RouterError;

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// An integer as msgpack stores it: unsigned, or negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

/// How deep nested arrays and maps may go in a skipped value: a payload cannot exhaust the
/// stack.
const MAX_DEPTH: u32 = 64;

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub fn at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    pub fn err(&self, what: &str) -> RouterError {
        RouterError::Payload(format!("{what} at byte {}", self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], RouterError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err("truncated payload"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, RouterError> {
        Ok(self.take(1)?[0])
    }

    fn be(&mut self, n: usize) -> Result<u64, RouterError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |a, &b| (a << 8) | u64::from(b)))
    }

    pub fn peek(&self) -> Result<u8, RouterError> {
        self.buf
            .get(self.pos)
            .copied()
            .ok_or_else(|| self.err("truncated payload"))
    }

    /// Consumes a nil and returns true, or consumes nothing and returns false.
    pub fn nil(&mut self) -> Result<bool, RouterError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    pub fn array(&mut self) -> Result<usize, RouterError> {
        let m = self.peek()?;
        let n = match m {
            0x90..=0x9f => {
                self.pos += 1;
                u64::from(m & 0x0f)
            }
            0xdc => {
                self.pos += 1;
                self.be(2)?
            }
            0xdd => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.err(&format!("expected an array, found marker 0x{m:02x}"))),
        };
        Ok(n as usize)
    }

    pub fn map(&mut self) -> Result<usize, RouterError> {
        let m = self.peek()?;
        let n = match m {
            0x80..=0x8f => {
                self.pos += 1;
                u64::from(m & 0x0f)
            }
            0xde => {
                self.pos += 1;
                self.be(2)?
            }
            0xdf => {
                self.pos += 1;
                self.be(4)?
            }
            _ => return Err(self.err(&format!("expected a map, found marker 0x{m:02x}"))),
        };
        Ok(n as usize)
    }

    /// Whether the next value is a map (the map form of an event) rather than an array.
    pub fn is_map(&self) -> Result<bool, RouterError> {
        Ok(matches!(self.peek()?, 0x80..=0x8f | 0xde | 0xdf))
    }

    pub fn str(&mut self) -> Result<&'a str, RouterError> {
        let at = self.pos;
        std::str::from_utf8(self.raw_str()?)
            .map_err(|_| RouterError::Payload(format!("a string that is not UTF-8 at byte {at}")))
    }

    /// A string's bytes, not checked for UTF-8 (field names and tags, compared as bytes).
    pub fn raw_str(&mut self) -> Result<&'a [u8], RouterError> {
        let m = self.peek()?;
        let n = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                usize::from(m & 0x1f)
            }
            0xd9 => {
                self.pos += 1;
                self.be(1)? as usize
            }
            0xda => {
                self.pos += 1;
                self.be(2)? as usize
            }
            0xdb => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => return Err(self.err(&format!("expected a string, found marker 0x{m:02x}"))),
        };
        self.take(n)
    }

    /// The next value if it is a byte string (bin 8/16/32); nothing consumed otherwise.
    pub fn bin(&mut self) -> Result<Option<&'a [u8]>, RouterError> {
        let n = match self.peek()? {
            0xc4 => 1,
            0xc5 => 2,
            0xc6 => 4,
            _ => return Ok(None),
        };
        self.pos += 1;
        let len = self.be(n)? as usize;
        self.take(len).map(Some)
    }

    /// The next value if it is an integer; nothing consumed otherwise.
    pub fn int(&mut self) -> Result<Option<Int>, RouterError> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U(u64::from(m))
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I(i64::from(m as i8))
            }
            0xcc..=0xcf => {
                self.pos += 1;
                Int::U(self.be(1 << (m - 0xcc))?)
            }
            0xd0..=0xd3 => {
                self.pos += 1;
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                // Sign-extend the n-byte two's complement value.
                Int::I(((raw << shift) as i64) >> shift)
            }
            _ => return Ok(None),
        };
        Ok(Some(v))
    }

    /// An unsigned integer that fits `limit`, for counts and indices such as `group_idx`.
    pub fn uint(&mut self, what: &str, limit: u64) -> Result<u64, RouterError> {
        let at = self.pos;
        match self.int()? {
            Some(Int::U(v)) if v <= limit => Ok(v),
            Some(Int::I(v)) if v >= 0 && v as u64 <= limit => Ok(v as u64),
            Some(v) => Err(RouterError::Payload(format!(
                "{what} must be an integer in 0..={limit}, got {v:?} at byte {at}"
            ))),
            None => Err(RouterError::Payload(format!(
                "{what} must be an integer, found marker 0x{:02x} at byte {at}",
                self.buf[at]
            ))),
        }
    }

    /// Skips one value of any type.
    pub fn skip(&mut self) -> Result<(), RouterError> {
        self.skip_depth(0)
    }

    fn skip_depth(&mut self, depth: u32) -> Result<(), RouterError> {
        if depth > MAX_DEPTH {
            return Err(self.err("values nested too deep"));
        }
        let m = self.byte()?;
        let (fixed, elems): (usize, usize) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * usize::from(m & 0x0f)),
            0x90..=0x9f => (0, usize::from(m & 0x0f)),
            0xa0..=0xbf => (usize::from(m & 0x1f), 0),
            0xc4 | 0xd9 => (self.be(1)? as usize, 0),
            0xc5 | 0xda => (self.be(2)? as usize, 0),
            0xc6 | 0xdb => (self.be(4)? as usize, 0),
            0xc7 => (self.be(1)? as usize + 1, 0),
            0xc8 => (self.be(2)? as usize + 1, 0),
            0xc9 => (self.be(4)? as usize + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc..=0xcf => (1 << (m - 0xcc), 0),
            0xd0..=0xd3 => (1 << (m - 0xd0), 0),
            0xd4..=0xd8 => ((1 << (m - 0xd4)) + 1, 0),
            0xdc => (0, self.be(2)? as usize),
            0xdd => (0, self.be(4)? as usize),
            0xde => (0, 2 * self.be(2)? as usize),
            0xdf => (0, 2 * self.be(4)? as usize),
            0xc1 => {
                self.pos -= 1;
                return Err(self.err("invalid msgpack marker 0xc1"));
            }
        };
        self.take(fixed)?;
        for _ in 0..elems {
            // Token ids, mostly: a positive fixint or a uint 8/16/32 skips without recursion.
            match self.buf.get(self.pos) {
                Some(0x00..=0x7f) => self.pos += 1,
                Some(0xcc) if self.pos + 2 <= self.buf.len() => self.pos += 2,
                Some(0xcd) if self.pos + 3 <= self.buf.len() => self.pos += 3,
                Some(0xce) if self.pos + 5 <= self.buf.len() => self.pos += 5,
                _ => self.skip_depth(depth + 1)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_of_every_width() {
        let cases: &[(&[u8], Int)] = &[
            (&[0x05], Int::U(5)),
            (&[0xff], Int::I(-1)),
            (&[0xcc, 0xff], Int::U(255)),
            (&[0xcd, 0x01, 0x00], Int::U(256)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Int::U(u64::MAX),
            ),
            (&[0xd0, 0x80], Int::I(-128)),
            (&[0xd1, 0xff, 0x00], Int::I(-256)),
            (&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0], Int::I(i64::MIN)),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).int().unwrap(), Some(*want), "{bytes:?}");
        }
    }

    #[test]
    fn truncated_and_invalid_input_is_an_error() {
        assert!(Reader::new(&[0xcf, 0x01]).int().is_err());
        assert!(Reader::new(&[0xc1]).skip().is_err());
        assert!(Reader::new(&[0x92, 0x01]).skip().is_err());
        assert!(Reader::new(&[0xa3, b'a']).str().is_err());
        assert!(Reader::new(&[0xa1, 0xff]).str().is_err());
        // Nested arrays deeper than the limit.
        let deep = vec![0x91u8; 200];
        assert!(Reader::new(&deep).skip().is_err());
    }
}
