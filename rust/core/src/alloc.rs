//! Fallible allocation: sizes that come from the caller (pool sizes, prompts, batches,
//! outputs) are reserved with `try_reserve`, so running out of memory is an
//! `Error::OutOfMemory` (Python `MemoryError`) and never aborts the process.

use crate::error::{Error, Result};

fn oom(what: &str, n: usize) -> Error {
    Error::OutOfMemory(format!("cannot allocate {what} ({n} entries)"))
}

/// An empty vector with room for `n` entries.
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom(what, n))?;
    Ok(v)
}

/// `n` copies of `value`.
pub fn try_filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// `f(0), f(1), ..., f(n - 1)` as a boxed slice.
pub fn try_boxed<T>(n: usize, f: impl FnMut(usize) -> T, what: &str) -> Result<Box<[T]>> {
    let mut v = try_with_capacity(n, what)?;
    v.extend((0..n).map(f));
    Ok(v.into_boxed_slice())
}

/// Room for `extra` more entries in `v`.
pub fn try_grow<T>(v: &mut Vec<T>, extra: usize, what: &str) -> Result<()> {
    v.try_reserve(extra).map_err(|_| oom(what, extra))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let err = try_with_capacity::<u64>(usize::MAX / 4, "a test vector").unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(ref m) if m.contains("a test vector")));
        assert!(try_filled(1 << 60, 0u32, "x").is_err());
        assert_eq!(try_boxed(3, |i| i * 2, "x").unwrap().as_ref(), &[0, 2, 4]);
        let mut v = vec![1u8];
        assert!(try_grow(&mut v, usize::MAX, "x").is_err());
        assert_eq!(v, vec![1]);
    }
}
