//! Delivering a call's evictions to its `evicted=` list (docs/semantics.md, "Duties"). Each
//! is a duty, a block the engine must copy out before reusing it, so none may be lost
//! silently: they are appended with the list type's own append (no method of the caller's
//! subclass runs), one that fails does not stop the rest, and those that could not be
//! appended come back in an `EvictionsNotDeliveredError` with the call's own outcome.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyList, PyType};
use pyo3::IntoPyObjectExt;

static NOT_DELIVERED: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Append the evictions `taken` (`(block, group, digest)`) to `list`, then return the call's
/// outcome `out`: itself when every one was appended, else an `EvictionsNotDeliveredError`
/// holding the ones that were not, `out`'s value or error, and the first append's error as
/// its cause.
pub fn deliver<'py, T>(
    py: Python<'py>,
    list: &Bound<'py, PyList>,
    taken: Vec<(u32, u8, pagedkv_core::Digest)>,
    out: PyResult<T>,
) -> PyResult<T>
where
    T: IntoPyObject<'py>,
{
    let mut lost = Vec::new();
    let mut cause = None;
    for (b, g, d) in taken {
        let appended = (b, g, PyBytes::new(py, d.as_bytes()))
            .into_pyobject(py)
            .and_then(|item| list.append(&item).map(|()| item));
        if let Err(e) = appended {
            lost.push((b, g, d));
            cause.get_or_insert(e);
        }
    }
    match cause {
        None => out,
        Some(cause) => Err(not_delivered(py, lost, out, cause)),
    }
}

fn not_delivered<'py, T: IntoPyObject<'py>>(
    py: Python<'py>,
    lost: Vec<(u32, u8, pagedkv_core::Digest)>,
    out: PyResult<T>,
    cause: PyErr,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let (result, error) = match out {
            Ok(v) => (v.into_py_any(py)?, py.None()),
            Err(e) => (py.None(), e.into_value(py).into_any()),
        };
        let what = if error.is_none(py) {
            "went through"
        } else {
            "raised (see .error)"
        };
        let msg = format!(
            "{} of the call's evictions could not be appended to evicted= ({cause}); the call \
             {what} and its state change stands: copy them out from .evicted (.result: the \
             call's result)",
            lost.len()
        );
        let ty = NOT_DELIVERED.import(py, "pagedkv.errors", "EvictionsNotDeliveredError")?;
        let err = PyErr::from_type(ty.clone(), msg);
        let value = err.value(py);
        let items = lost
            .iter()
            .map(|(b, g, d)| (*b, *g, PyBytes::new(py, d.as_bytes())));
        value.setattr("evicted", PyList::new(py, items)?)?;
        value.setattr("result", result)?;
        value.setattr("error", error)?;
        Ok(err)
    };
    match build() {
        Ok(err) => {
            err.set_cause(py, Some(cause));
            err
        }
        // Out of memory even for the report: the append's own error, at least not silent.
        Err(_) => cause,
    }
}
