//! `pagedkv._core.HeldBlocks`: the blocks a publisher's stream says its engine holds (integer
//! hashes), kept in Rust so that a snapshot is written out as compact parts at memory speed
//! (pagedkv-router's `held.rs` and `compact.rs`; docs/events.md).

use crate::router::router_err;
use pagedkv_router::HeldSet;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Mutex, MutexGuard};

/// Keys a compact part carries at most, unless asked otherwise (2 MiB of integer hashes).
const PER_PART: usize = 1 << 18;

/// The blocks one engine's KV event stream holds, per medium and group (integer hashes).
#[pyclass(frozen, module = "pagedkv._core", name = "HeldBlocks")]
pub struct PyHeldBlocks {
    inner: Mutex<HeldSet<u64>>,
}

impl PyHeldBlocks {
    fn held(&self) -> MutexGuard<'_, HeldSet<u64>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyHeldBlocks {
    #[new]
    #[pyo3(text_signature = "()")]
    fn new() -> Self {
        Self {
            inner: Mutex::new(HeldSet::default()),
        }
    }

    /// Apply one vLLM `KVEventBatch` payload (integer hashes). One that does not decode
    /// raises `KVEventPayloadError` and changes nothing.
    fn apply(&self, py: Python<'_>, payload: &Bound<'_, PyBytes>) -> PyResult<()> {
        let bytes = payload.as_bytes();
        py.detach(|| self.held().apply_payload(bytes))
            .map_err(|e| router_err(py, e))
    }

    /// Every block as compact snapshot parts of at most `per_part` blocks.
    #[pyo3(signature = (per_part = PER_PART), text_signature = "(self, /, per_part=262144)")]
    fn parts<'py>(&self, py: Python<'py>, per_part: usize) -> Vec<Bound<'py, PyBytes>> {
        let parts = py.detach(|| self.held().parts(per_part));
        parts.iter().map(|p| PyBytes::new(py, p)).collect()
    }

    fn __len__(&self) -> usize {
        self.held().len()
    }
}
