//! Python arguments to plain Rust values: token ids, sequence ids, counts. Accepts lists of
//! ints and 1-D numpy integer arrays; anything else is an `InvalidArgumentError` naming it.

use crate::errors::invalid;
use numpy::{
    Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFrozenSet, PyInt, PyList, PySet, PyString};

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
    // A contiguous array converts from a plain slice (a tight loop); strided ones by view.
    if let Ok(slice) = arr.as_slice() {
        return convert(slice.iter().copied(), what, range, obj.py());
    }
    let view = arr.as_array();
    convert(view.iter().copied(), what, range, obj.py())
}

/// A 1-D integer numpy array, or a sequence of Python ints, as `T`s.
fn ints<T>(obj: &Bound<'_, PyAny>, what: &str, range: &str) -> PyResult<Vec<T>>
where
    T: TryFrom<i64> + TryFrom<u64> + TryFrom<i32> + TryFrom<u32>,
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
        let native = dtype.is_native_byteorder() != Some(false);
        return match (dtype.kind(), dtype.itemsize()) {
            _ if !native && matches!(dtype.kind(), b'i' | b'u') => {
                let wide = obj.call_method1("astype", ("int64",))?;
                from_array::<i64, T>(&wide, what, range)
            }
            (b'i', 8) => from_array::<i64, T>(obj, what, range),
            (b'u', 8) => from_array::<u64, T>(obj, what, range),
            (b'i', 4) => from_array::<i32, T>(obj, what, range),
            (b'u', 4) => from_array::<u32, T>(obj, what, range),
            // Narrow integers widen exactly; one conversion keeps the dispatch short.
            (b'i' | b'u', _) => {
                let wide = obj.call_method1("astype", ("int64",))?;
                from_array::<i64, T>(&wide, what, range)
            }
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
    // Order matters (token positions, batch rows): unordered containers are a bug, not input.
    if obj.is_instance_of::<PyDict>()
        || obj.is_instance_of::<PySet>()
        || obj.is_instance_of::<PyFrozenSet>()
    {
        let name = obj.get_type().name()?;
        return Err(invalid(
            py,
            format!("{what} must be an ordered sequence of ints, got {name}"),
        ));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .enumerate()
            .map(|(i, item)| int_item(&item, Name(what, Some(i)), range))
            .collect();
    }
    let items = obj.try_iter().map_err(|_| {
        invalid(
            py,
            format!("{what} must be a sequence of ints or a 1-D integer array"),
        )
    })?;
    items
        .enumerate()
        .map(|(i, item)| int_item(&item?, Name(what, Some(i)), range))
        .collect()
}

/// What an argument is called in messages: `what`, or `what[i]` for an element. Formatted
/// only when a message is written, never on the hot path.
#[derive(Clone, Copy)]
struct Name<'a>(&'a str, Option<usize>);

impl std::fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.1 {
            Some(i) => write!(f, "{}[{i}]", self.0),
            None => f.write_str(self.0),
        }
    }
}

/// One Python int or numpy integer scalar (not a bool) as `T`.
fn int_item<T>(item: &Bound<'_, PyAny>, what: Name<'_>, range: &str) -> PyResult<T>
where
    T: TryFrom<i64> + TryFrom<u64>,
{
    let py = item.py();
    let out_of_range =
        |v: &dyn std::fmt::Display| invalid(py, format!("{what} = {v} is out of range {range}"));
    if !item.is_instance_of::<PyBool>() {
        if let Ok(v) = item.extract::<i64>() {
            return T::try_from(v).map_err(|_| out_of_range(&v));
        }
        if let Ok(v) = item.extract::<u64>() {
            return T::try_from(v).map_err(|_| out_of_range(&v));
        }
        if item.is_instance_of::<PyInt>() || item.hasattr("__index__")? {
            return Err(out_of_range(item));
        }
    }
    let name = item.get_type().name()?;
    Err(invalid(py, format!("{what} must be an int, got {name}")))
}

/// An optional int argument in `lo..=hi`; `None` means `default`.
pub fn int_arg(
    obj: Option<&Bound<'_, PyAny>>,
    default: i64,
    what: &str,
    lo: i64,
    hi: i64,
) -> PyResult<i64> {
    let Some(obj) = obj else { return Ok(default) };
    let range = format!("[{lo}, {hi}]");
    let v: i64 = int_item(obj, Name(what, None), &range)?;
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            obj.py(),
            format!("{what} = {v} is out of range {range}"),
        ))
    }
}

/// An optional unsigned 64-bit argument (seeds, adapter ids); `None` means `default`.
pub fn u64_arg(obj: Option<&Bound<'_, PyAny>>, default: u64, what: &str) -> PyResult<u64> {
    obj.map_or(Ok(default), |o| int_item(o, Name(what, None), "[0, 2**64)"))
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
    int_item(obj, Name("sequence id", None), "[0, 2**64)")
}

/// Per-sequence counts: one int for all, or one per sequence; none negative.
pub fn counts(obj: &Bound<'_, PyAny>, n: usize, what: &str) -> PyResult<Vec<usize>> {
    if obj.cast::<PyUntypedArray>().is_err() && obj.try_iter().is_err() {
        let v: usize = int_item(obj, Name(what, None), "[0, 2**63)")?;
        return Ok(vec![v; n]);
    }
    ints::<usize>(obj, what, "[0, 2**63)")
}
