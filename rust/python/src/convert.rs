//! Python arguments to plain Rust values: token ids, sequence ids, counts. Accepts lists of
//! ints and 1-D numpy integer arrays; anything else is an `InvalidArgumentError` naming it.

use crate::errors::invalid;
use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

/// Integers of any numpy integer dtype, or a Python sequence of ints, as i128 for checking.
fn ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i128>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(invalid(
                py,
                format!("{what} must be 1-D, got {} dimensions", arr.ndim()),
            ));
        }
        macro_rules! try_dtype {
            ($($t:ty),*) => {$(
                if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, $t>>() {
                    return Ok(a.as_array().iter().map(|&v| v as i128).collect());
                }
            )*};
        }
        let dtype = arr.dtype();
        if dtype.is_equiv_to(&numpy::dtype::<bool>(py))
            || dtype.kind() != b'i' && dtype.kind() != b'u'
        {
            return Err(invalid(
                py,
                format!("{what} must have an integer dtype, got {dtype}"),
            ));
        }
        try_dtype!(i64, i32, u32, u64, i16, u16, i8, u8);
        return Err(invalid(
            py,
            format!("{what} has an unsupported dtype {dtype}"),
        ));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(invalid(
            py,
            format!("{what} must be a sequence of ints, got a string"),
        ));
    }
    let seq = obj.try_iter().map_err(|_| {
        invalid(
            py,
            format!("{what} must be a sequence of ints or a 1-D integer array"),
        )
    })?;
    seq.map(|item| {
        let item = item?;
        if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
            return Err(invalid(
                py,
                format!("{what} must hold ints, got {}", item.get_type().name()?),
            ));
        }
        item.extract::<i128>()
            .map_err(|_| invalid(py, format!("{what} holds an integer out of range")))
    })
    .collect()
}

fn fast_u32(obj: &Bound<'_, PyAny>) -> Option<Vec<u32>> {
    let a = obj.extract::<PyReadonlyArray1<'_, u32>>().ok()?;
    Some(a.as_array().to_vec())
}

/// Token ids: non-empty, each in `[0, 2**32)`.
pub fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let out = match fast_u32(obj) {
        Some(v) => v,
        None => ints(obj, "token_ids")?
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                u32::try_from(t).map_err(|_| {
                    invalid(
                        py,
                        format!("token id {t} at position {i} is out of range [0, 2**32)"),
                    )
                })
            })
            .collect::<PyResult<_>>()?,
    };
    if out.is_empty() {
        return Err(invalid(py, "token_ids must not be empty"));
    }
    Ok(out)
}

fn fast_u64(obj: &Bound<'_, PyAny>) -> Option<Vec<u64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        let view = a.as_array();
        if view.iter().all(|&v| v >= 0) {
            return Some(view.iter().map(|&v| v as u64).collect());
        }
        return None;
    }
    obj.extract::<PyReadonlyArray1<'_, u64>>()
        .ok()
        .map(|a| a.as_array().to_vec())
}

/// Sequence ids of a batch: each in `[0, 2**64)`.
pub fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Some(v) = fast_u64(obj) {
        return Ok(v);
    }
    let py = obj.py();
    ints(obj, "seq_ids")?
        .into_iter()
        .map(|v| {
            u64::try_from(v)
                .map_err(|_| invalid(py, format!("sequence id {v} is out of range [0, 2**64)")))
        })
        .collect()
}

/// One sequence id.
pub fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(v) = obj.extract::<u64>() {
        if !obj.is_instance_of::<PyBool>() {
            return Ok(v);
        }
    }
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(invalid(
            py,
            format!("sequence id must be an int, got {}", obj.get_type().name()?),
        ));
    }
    Err(invalid(
        py,
        format!("sequence id {obj} is out of range [0, 2**64)"),
    ))
}

/// A count that must not be negative.
pub fn count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        return Err(invalid(
            py,
            format!("{what} must be an int, got {}", obj.get_type().name()?),
        ));
    }
    obj.extract::<usize>()
        .map_err(|_| invalid(py, format!("{what} must be a non-negative int, got {obj}")))
}

/// Per-sequence counts: one int for all, or one per sequence.
pub fn counts(obj: &Bound<'_, PyAny>, n: usize, what: &str) -> PyResult<Vec<usize>> {
    if obj.is_instance_of::<PyInt>() {
        return Ok(vec![count(obj, what)?; n]);
    }
    let py = obj.py();
    ints(obj, what)?
        .into_iter()
        .map(|v| {
            usize::try_from(v)
                .map_err(|_| invalid(py, format!("{what} must not be negative, got {v}")))
        })
        .collect()
}
