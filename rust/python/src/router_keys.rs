//! A lookup's integer block hashes from Python, by the cheapest read each form allows.
//!
//! A lookup's own work is 0.5 to 4 us (docs/router.md), so reading its argument must cost
//! far less than the generic conversion (about 28 ns an int; half of vLLM's hashes are above
//! 2**63, that conversion's slow path). The forms, fastest first:
//! - any buffer of 8-byte unsigned ints (a numpy uint64 array, `array('Q')`, a memoryview of
//!   either): one copy of its bytes, no per-item check;
//! - `bytes` (or `bytearray`) of whole 8-byte hashes in native byte order (what
//!   `ndarray.tobytes()` and `array('Q').tobytes()` write): one copy;
//! - an exact list of exact ints: each read straight from its object (about 3 ns).
//!
//! Anything else (tuples, ranges, numpy arrays of other integer dtypes, lists with values out
//! of range) goes the generic way, with its errors.

use crate::convert::u64s;
use crate::errors::invalid;
use pyo3::buffer::{Element, PyUntypedBuffer};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList};

/// Block hashes of an int index from `obj`.
pub fn int_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Some(v) = fast_list(obj) {
        return Ok(v);
    }
    if let Ok(b) = obj.cast_exact::<PyBytes>() {
        return from_bytes(obj.py(), b.as_bytes());
    }
    if let Ok(b) = obj.cast_exact::<PyByteArray>() {
        // SAFETY: the GIL is held and no Python code runs while the bytes are read (copied
        // out at once), so nothing can resize the bytearray meanwhile.
        return from_bytes(obj.py(), unsafe { b.as_bytes() });
    }
    // SAFETY: `obj` is a live object; the call only reads its type's buffer slot.
    if unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) } != 0 {
        if let Some(v) = from_buffer(obj)? {
            return Ok(v);
        }
    }
    u64s(obj, "block_hashes")
}

/// Whole 8-byte hashes, native byte order.
fn from_bytes(py: Python<'_>, b: &[u8]) -> PyResult<Vec<u64>> {
    if b.len() % 8 != 0 {
        return Err(invalid(
            py,
            format!(
                "block_hashes as bytes must hold whole 8-byte hashes, got {} bytes",
                b.len()
            ),
        ));
    }
    Ok(b.chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// A buffer of 8-byte unsigned ints, one dimension, copied out (so the walk, which may run
/// with the GIL released, never reads memory a Python thread could write meanwhile). `None`
/// for a buffer of another item type, left to the generic conversion.
fn from_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u64>>> {
    let Ok(buf) = PyUntypedBuffer::get(obj) else {
        return Ok(None);
    };
    if buf.dimensions() != 1 || !<u64 as Element>::is_compatible_format(buf.format()) {
        return Ok(None); // the generic conversion names the problem
    }
    if buf.item_count() == 0 {
        return Ok(Some(Vec::new())); // an empty array's pointer may be of any alignment
    }
    let Ok(typed) = buf.into_typed::<u64>() else {
        return Ok(None);
    };
    let mut out = vec![0u64; typed.item_count()];
    typed.copy_to_slice(obj.py(), &mut out)?;
    Ok(Some(out))
}

/// An exact list of exact ints, each in [0, 2**64), read straight from the list. `None` for
/// anything else, and for a list with a value out of range, which then goes the generic way
/// (the same accepted inputs and errors).
///
/// Borrowed items (`PyList_GetItem`), no iterator: 4 ns an int below 2**62 against 9 through
/// the list's iterator. Each int is read by `as_u64`, exact and without a byte array (see
/// there): half of vLLM's hashes are above 2**63, where `PyLong_AsUnsignedLongLong` took
/// about 12 ns an int through one. Tried and slower: taking the items first and prefetching
/// their objects before reading them (9.0 against 7.7 ns an int, 374-int lists); reading each
/// int as the walk came within 16 blocks of it, to overlap the two (lookup p99 8.1 to 8.7
/// against 5.9 to 6.8 us, 64 engines, 1 M memberships, load 3.9): the walk's shard locks are
/// full fences, which put the ints' cache misses on its path.
fn fast_list(obj: &Bound<'_, PyAny>) -> Option<Vec<u64>> {
    let list = obj.cast_exact::<PyList>().ok()?;
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `list` is a live exact list and i < its length, read just above: no Python
        // code runs in this loop (only conversions of exact ints, which call none), so the
        // list cannot change under it and the borrowed item stays alive in it. A conversion
        // that fails sets an exception, cleared here before returning, so none leaks.
        unsafe {
            let item = pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t);
            if item.is_null() || pyo3::ffi::PyLong_CheckExact(item) == 0 {
                pyo3::ffi::PyErr_Clear();
                return None;
            }
            let v = as_u64(item);
            if v == u64::MAX && !pyo3::ffi::PyErr_Occurred().is_null() {
                pyo3::ffi::PyErr_Clear();
                return None;
            }
            out.push(v);
        }
    }
    Some(out)
}

/// An exact int's value in [0, 2**64); on failure `u64::MAX` with an exception set (the
/// caller checks `PyErr_Occurred` then). Where C's `unsigned long` is 64 bits (LP64: Linux,
/// macOS), `PyLong_AsUnsignedLong`: CPython reads the digits in a loop with an exact overflow
/// check, where `PyLong_AsUnsignedLongLong` goes through a byte array for every value above
/// 2**30 (3 ns an int against 12 above 2**63, CPython 3.11). Elsewhere (Windows' 32-bit
/// `long`) the latter.
///
/// # Safety
/// `item` is a live exact int and the GIL is held.
#[inline]
unsafe fn as_u64(item: *mut pyo3::ffi::PyObject) -> u64 {
    if std::mem::size_of::<std::ffi::c_ulong>() == 8 {
        // SAFETY: the caller's contract; `c_ulong` is 64 bits here, so the cast is lossless
        // (`u64::MAX` stays `u64::MAX`, the error value).
        unsafe { pyo3::ffi::PyLong_AsUnsignedLong(item) as u64 }
    } else {
        // SAFETY: the caller's contract.
        unsafe { pyo3::ffi::PyLong_AsUnsignedLongLong(item) }
    }
}
