//! `allocate(retention=..., decode_retention=...)`: Python tuples to the core's
//! `RetentionSpec`, which checks the ranges themselves (order, overlap, emptiness).

use crate::convert::{int_arg, wrong_type};
use crate::errors::{invalid, IntoPy};
use pagedkv_core::{Retention, RetentionRange, RetentionSpec, MAX_PRIORITY};
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyInt, PySequence};

/// `duration_s`: None (for good) or a finite number >= 0, in seconds.
fn duration(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<f64>> {
    if obj.is_none() {
        return Ok(None);
    }
    let ok = (obj.is_instance_of::<PyFloat>() || obj.is_instance_of::<PyInt>())
        && !obj.is_instance_of::<pyo3::types::PyBool>();
    if !ok {
        return Err(wrong_type(
            obj.py(),
            format!("{what}: duration_s must be a number or None"),
        ));
    }
    let d: f64 = obj.extract()?;
    if !(d.is_finite() && d >= 0.0) {
        return Err(invalid(
            obj.py(),
            format!("{what}: duration_s must be a finite number >= 0, got {d}"),
        ));
    }
    Ok(Some(d))
}

fn retention(
    priority: &Bound<'_, PyAny>,
    dur: &Bound<'_, PyAny>,
    what: &str,
) -> PyResult<Retention> {
    let priority = int_arg(
        priority,
        &format!("{what}: priority"),
        0,
        MAX_PRIORITY.into(),
    )? as u8;
    Ok(Retention {
        priority,
        duration: duration(dur, what)?,
    })
}

/// A fixed-length tuple or list.
fn items<'py>(obj: &Bound<'py, PyAny>, n: usize, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let seq = obj
        .cast::<PySequence>()
        .map_err(|_| wrong_type(obj.py(), format!("{what} must be a tuple")))?;
    let items: Vec<_> = seq.try_iter()?.collect::<PyResult<_>>()?;
    if items.len() != n {
        return Err(invalid(
            obj.py(),
            format!("{what} must have {n} items, got {}", items.len()),
        ));
    }
    Ok(items)
}

/// `retention`: `[(start_token, end_token or None, priority, duration_s or None), ...]`;
/// `decode_retention`: `(priority, duration_s or None)`. None when neither is given.
pub fn retention_arg(
    py: Python<'_>,
    ranges: Option<&Bound<'_, PyAny>>,
    decode: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<RetentionSpec>> {
    let (ranges, decode) = (
        ranges.filter(|r| !r.is_none()),
        decode.filter(|d| !d.is_none()),
    );
    if ranges.is_none() && decode.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    if let Some(list) = ranges {
        let seq = list
            .cast::<PySequence>()
            .ok()
            .filter(|_| !list.is_instance_of::<pyo3::types::PyString>())
            .ok_or(())
            .map_err(|_| wrong_type(py, "retention must be a list of tuples".to_string()))?;
        for (i, r) in seq.try_iter()?.enumerate() {
            let what = format!("retention[{i}]");
            let it = items(&r?, 4, &what)?;
            let start = int_arg(&it[0], &format!("{what}: start_token"), 0, i64::MAX)? as usize;
            let end = if it[1].is_none() {
                None
            } else {
                Some(int_arg(&it[1], &format!("{what}: end_token"), 0, i64::MAX)? as usize)
            };
            out.push(RetentionRange {
                start,
                end,
                retention: retention(&it[2], &it[3], &what)?,
            });
        }
    }
    let decode = match decode {
        Some(d) => {
            let it = items(d, 2, "decode_retention")?;
            Some(retention(&it[0], &it[1], "decode_retention")?)
        }
        None => None,
    };
    RetentionSpec::new(out, decode).py(py).map(Some)
}
