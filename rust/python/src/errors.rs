//! Core errors as the Python exceptions of `pagedkv.errors` (defined in Python so that they
//! can subclass both `PagedKVError` and the builtin users expect).

use pagedkv_core::Error;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static UNKNOWN: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DUPLICATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SWAPPED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVALID: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVARIANT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static NOT_SWAPPED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OVERFLOW: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BROKEN: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static EVENTS_OVERFLOW: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn raise(py: Python<'_>, cell: &PyOnceLock<Py<PyType>>, name: &str, msg: String) -> PyErr {
    match cell.import(py, "pagedkv.errors", name) {
        Ok(ty) => PyErr::from_type(ty.clone(), msg),
        Err(e) => e,
    }
}

pub fn to_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::UnknownSequence(_) => raise(py, &UNKNOWN, "UnknownSequenceError", msg),
        Error::DuplicateSequence(_) => raise(py, &DUPLICATE, "DuplicateSequenceError", msg),
        Error::Swapped(_) => raise(py, &SWAPPED, "SequenceSwappedError", msg),
        Error::NotSwapped(_) => raise(py, &NOT_SWAPPED, "SequenceNotSwappedError", msg),
        Error::InvalidArgument(_) => raise(py, &INVALID, "InvalidArgumentError", msg),
        Error::Invariant(_) => raise(py, &INVARIANT, "InvariantError", msg),
        Error::RefcountOverflow { .. } => raise(py, &OVERFLOW, "RefcountOverflowError", msg),
        Error::OutOfMemory(_) => PyMemoryError::new_err(msg),
        Error::Broken(_) => raise(py, &BROKEN, "ManagerBrokenError", msg),
        Error::EventsOverflowed { .. } => raise(py, &EVENTS_OVERFLOW, "KVEventsOverflowError", msg),
        // Only non-blocking mode returns it, and the binding retries those calls blocking.
        Error::WouldBlock => PyRuntimeError::new_err(msg),
    }
}

/// An `InvalidArgumentError` raised by the binding's own argument checks.
pub fn invalid(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    to_pyerr(py, Error::InvalidArgument(msg.into()))
}

/// Map a core result to a Python one.
pub trait IntoPy<T> {
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_pyerr(py, e))
    }
}
