//! `pagedkv._core.RunningBatch`: a scheduler's decode batch kept across steps (the core's
//! `RunningBatch`). Argument and result conversion only.

use crate::convert::{batch_tokens, seq_ids};
use crate::errors::{invalid, IntoPy};
use crate::manager::{evicted_arg, pairs_array, run_evicting, PyBlockManager};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2};
use pagedkv_core::{nonblocking, BlockManager, Error, Result as CoreResult, RunningBatch};
use pyo3::prelude::*;

/// Batches at least this long release the GIL while the core works (as the manager's).
const DETACH_MIN_BATCH: usize = 64;

/// The sequences a scheduler decodes step after step, resolved once: `step(token_ids)` is
/// `append_batch(seq_ids, token_ids)` plus the new tokens' `slot_mapping`, without looking
/// any id up. Made by `BlockManager.running_batch()`; safe to call from many threads.
#[pyclass(frozen, module = "pagedkv._core", name = "RunningBatch")]
pub struct PyRunningBatch {
    mgr: Py<PyBlockManager>,
    batch: RunningBatch,
}

impl PyRunningBatch {
    pub fn new(mgr: Py<PyBlockManager>, batch: RunningBatch) -> Self {
        Self { mgr, batch }
    }

    /// Run a core call on the manager, as the manager's methods do (`manager::run`).
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        detach: bool,
        call: impl Fn(&BlockManager, &RunningBatch) -> CoreResult<T> + Send + Sync,
    ) -> PyResult<T> {
        let mgr = &self.mgr.get().inner;
        let call = || call(mgr, &self.batch);
        let out = if detach {
            py.detach(call)
        } else {
            match nonblocking(call) {
                Err(Error::WouldBlock) => py.detach(call),
                other => other,
            }
        };
        out.py(py)
    }
}

#[pymethods]
impl PyRunningBatch {
    /// Add live, resident sequences to the end of the batch (all or nothing).
    fn add(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        self.run(py, false, |m, b| m.batch_add(b, &ids))
    }

    /// Remove members, freed or not (all or nothing); the rest keep their order.
    fn remove(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        self.run(py, false, |m, b| m.batch_remove(b, &ids))
    }

    /// One token to each member, in `seq_ids` order, all or nothing. Returns `(slot_mapping,
    /// cow_pairs)`: the new tokens' int64 slots (with `groups=`, one row per group: shape
    /// `(num_groups, len(batch))`) and the int32 `(k, 2)` copy-on-write pairs; or None if
    /// the blocks do not fit (nothing changed). `evicted`: a list that gets the `(block,
    /// group, digest)` of the cached blocks this step evicted (`record_evictions`).
    #[allow(clippy::type_complexity)]
    #[pyo3(
        signature = (token_ids, *, evicted=None),
        text_signature = "($self, token_ids, *, evicted=None)"
    )]
    fn step<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        evicted: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyArray2<i32>>)>> {
        let evicted = evicted_arg(evicted, self.mgr.get().records())?;
        let toks = batch_tokens(token_ids)?;
        // Before anything changes: its results are arrays.
        crate::numpy_api::numpy_api(py, "for a running batch's step (arrays)")?;
        let detach = toks.len() >= DETACH_MIN_BATCH;
        let mgr = &self.mgr.get().inner;
        let out = run_evicting(py, detach, evicted.as_ref(), || {
            mgr.batch_step(&self.batch, &toks)
        })?;
        let Some((slots, pairs)) = out else {
            return Ok(None);
        };
        let slots = if mgr.is_grouped() {
            let shape = (mgr.kinds().len(), toks.len());
            Array2::from_shape_vec(shape, slots)
                .map_err(|e| invalid(py, format!("slot mapping shape: {e}")))?
                .into_pyarray(py)
                .into_any()
        } else {
            slots.into_pyarray(py).into_any()
        };
        Ok(Some((slots, pairs_array(py, pairs)?)))
    }

    /// The members' ids in batch order (the order of `step`'s tokens and slots).
    #[getter]
    fn seq_ids(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.run(py, false, |_, b| b.ids())
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, false, |_, b| b.len())
    }
}
