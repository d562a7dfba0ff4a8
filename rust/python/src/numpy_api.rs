//! numpy, loaded only where an argument or a result needs it. rust-numpy reads numpy's C API
//! table on first use and panics when numpy cannot be imported, so every numpy call of the
//! binding goes through here first: lists, tuples and ranges need no numpy at all, and a
//! result that is an array raises an `ImportError` naming what needed it, never a panic.

use numpy::npyffi::{self, NpyTypes};
use pyo3::exceptions::PyImportError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once numpy's C API table is read; never cleared (rust-numpy keeps the table for the
/// process). Relaxed: a flag read on its own, set under the GIL after the table is read.
static READY: AtomicBool = AtomicBool::new(false);

/// Load numpy's C API: import numpy and its array API capsule as rust-numpy does (an
/// `ImportError` saying that `what` needs numpy when that fails), then let rust-numpy read
/// the table, which now cannot fail: the same modules are imported, and no Python code runs
/// in between.
pub fn numpy_api(py: Python<'_>, what: &str) -> PyResult<()> {
    if READY.load(Ordering::Relaxed) {
        return Ok(());
    }
    let load = || -> PyResult<()> {
        let numpy = py.import("numpy")?;
        let version = numpy.getattr("__version__")?;
        let major: u8 = py
            .import("numpy.lib")?
            .getattr("NumpyVersion")?
            .call1((version,))?
            .getattr("major")?
            .extract()?;
        let core = if major >= 2 {
            "numpy._core.multiarray"
        } else {
            "numpy.core.multiarray"
        };
        let capsule = py.import(core)?.getattr("_ARRAY_API")?;
        capsule.cast_into::<PyCapsule>()?.pointer_checked(None)?;
        Ok(())
    };
    if let Err(cause) = load() {
        let err = PyImportError::new_err(format!("pagedkv needs numpy {what}: {cause}"));
        err.set_cause(py, Some(cause));
        return Err(err);
    }
    // SAFETY: reading a type object only makes rust-numpy read the API table (the capsule
    // found above) and returns a pointer, which is not used.
    unsafe {
        npyffi::get_type_object(py, NpyTypes::PyArray_Type);
    }
    READY.store(true, Ordering::Relaxed);
    Ok(())
}

/// Whether an argument may be a numpy array or scalar, with numpy's C API loaded if so.
/// `false` when numpy cannot be imported and was never loaded: no numpy object exists then,
/// and the caller reads its argument without numpy. An `ImportError` when numpy's extension
/// was loaded (numpy objects may exist) but cannot be imported now.
pub fn numpy_loaded(py: Python<'_>) -> PyResult<bool> {
    let Err(err) = numpy_api(py, "to read a numpy argument") else {
        return Ok(true);
    };
    let modules = py
        .import("sys")?
        .getattr(intern!(py, "modules"))?
        .cast_into::<PyDict>()?;
    for name in [
        "numpy._core._multiarray_umath",
        "numpy.core._multiarray_umath",
    ] {
        if modules.get_item(name)?.is_some_and(|m| !m.is_none()) {
            return Err(err);
        }
    }
    Ok(false)
}
