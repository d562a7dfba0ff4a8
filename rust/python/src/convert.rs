//! Python arguments to plain Rust values: token ids, sequence ids, counts. Accepts lists of
//! ints and 1-D numpy integer arrays; anything else is an `InvalidArgumentError` naming it.

use crate::errors::invalid;
use numpy::{
    Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyString};

/// Convert each element with `T::try_from`, naming the first one out of range.
fn convert<S, T>(
    values: impl Iterator<Item = S>,
    what: &str,
    range: &str,
    py: Python<'_>,
) -> PyResult<Vec<T>>
where
    S: Copy + std::fmt::Display,
    T: TryFrom<S>,
{
    values
        .enumerate()
        .map(|(i, v)| {
            T::try_from(v)
                .map_err(|_| invalid(py, format!("{what}[{i}] = {v} is out of range {range}")))
        })
        .collect()
}

fn from_array<'py, S, T>(obj: &Bound<'py, PyAny>, what: &str, range: &str) -> PyResult<Vec<T>>
where
    S: Element + Copy + std::fmt::Display,
    T: TryFrom<S>,
{
    let arr = obj.extract::<PyReadonlyArray1<'py, S>>()?;
    let view = arr.as_array();
    convert(view.iter().copied(), what, range, obj.py())
}

/// A 1-D integer numpy array, or a sequence of Python ints, as `T`s.
fn ints<T>(obj: &Bound<'_, PyAny>, what: &str, range: &str) -> PyResult<Vec<T>>
where
    T: TryFrom<i64> + TryFrom<u64> + TryFrom<i32> + TryFrom<u32> + TryFrom<i16> + TryFrom<u16>,
    T: TryFrom<i8> + TryFrom<u8>,
{
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Err(invalid(
                py,
                format!("{what} must be 1-D, got {} dimensions", arr.ndim()),
            ));
        }
        let dtype = arr.dtype();
        return match (dtype.kind(), dtype.itemsize()) {
            (b'i', 8) => from_array::<i64, T>(obj, what, range),
            (b'u', 8) => from_array::<u64, T>(obj, what, range),
            (b'i', 4) => from_array::<i32, T>(obj, what, range),
            (b'u', 4) => from_array::<u32, T>(obj, what, range),
            (b'i', 2) => from_array::<i16, T>(obj, what, range),
            (b'u', 2) => from_array::<u16, T>(obj, what, range),
            (b'i', 1) => from_array::<i8, T>(obj, what, range),
            (b'u', 1) => from_array::<u8, T>(obj, what, range),
            _ => Err(invalid(
                py,
                format!("{what} must have an integer dtype, got {dtype}"),
            )),
        };
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(invalid(
            py,
            format!("{what} must be a sequence of ints, got a string"),
        ));
    }
    let items = obj.try_iter().map_err(|_| {
        invalid(
            py,
            format!("{what} must be a sequence of ints or a 1-D integer array"),
        )
    })?;
    items
        .enumerate()
        .map(|(i, item)| {
            let item = item?;
            if item.is_instance_of::<PyBool>() || !item.is_instance_of::<PyInt>() {
                let name = item.get_type().name()?;
                return Err(invalid(
                    py,
                    format!("{what}[{i}] must be an int, got {name}"),
                ));
            }
            let out_of_range =
                || invalid(py, format!("{what}[{i}] = {item} is out of range {range}"));
            match item.extract::<i64>() {
                Ok(v) => T::try_from(v).map_err(|_| out_of_range()),
                Err(_) => item
                    .extract::<u64>()
                    .ok()
                    .and_then(|v| T::try_from(v).ok())
                    .ok_or_else(out_of_range),
            }
        })
        .collect()
}

/// Token ids: non-empty, each in `[0, 2**32)`.
pub fn tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let out = ints::<u32>(obj, "token_ids", "[0, 2**32)")?;
    if out.is_empty() {
        return Err(invalid(obj.py(), "token_ids must not be empty"));
    }
    Ok(out)
}

/// One token per sequence of a batch (may be empty with an empty batch).
pub fn batch_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    ints::<u32>(obj, "token_ids", "[0, 2**32)")
}

/// Sequence ids of a batch: each in `[0, 2**64)`.
pub fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    ints::<u64>(obj, "seq_ids", "[0, 2**64)")
}

/// One sequence id.
pub fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() || !obj.is_instance_of::<PyInt>() {
        let name = obj.get_type().name()?;
        return Err(invalid(
            py,
            format!("sequence id must be an int, got {name}"),
        ));
    }
    obj.extract::<u64>()
        .map_err(|_| invalid(py, format!("sequence id {obj} is out of range [0, 2**64)")))
}

/// Per-sequence counts: one int for all, or one per sequence; none negative.
pub fn counts(obj: &Bound<'_, PyAny>, n: usize, what: &str) -> PyResult<Vec<usize>> {
    let py = obj.py();
    if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        let v = obj
            .extract::<usize>()
            .map_err(|_| invalid(py, format!("{what} must not be negative, got {obj}")))?;
        return Ok(vec![v; n]);
    }
    ints::<usize>(obj, what, "[0, 2**63)")
}
