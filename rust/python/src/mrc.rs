//! `pagedkv._core.MrcStream`: the miss-ratio curve recorder's stream (pagedkv-sim's
//! `MrcStream`), for `pagedkv.sim.mrc_fast`. Argument and result conversion only.

use crate::convert::{batch_tokens, int_arg, seq_id, seq_ids, u64_arg};
use crate::errors::{invalid, to_pyerr};
use numpy::{IntoPyArray, PyArray1};
use pagedkv_core::Error;
use pagedkv_sim::{MrcStream, StreamError};
use pyo3::prelude::*;

fn stream_err(py: Python<'_>, e: StreamError) -> PyErr {
    match e {
        StreamError::UnknownSeq(id) => to_pyerr(py, Error::UnknownSequence(id)),
        other => invalid(py, other.to_string()),
    }
}

/// The stream of lookups and touches of `pagedkv.sim.mrc.MRCRecorder`, kept in Rust. Not for
/// use from several threads at once (a concurrent call raises, as PyO3 borrows it).
#[pyclass(module = "pagedkv._core", name = "MrcStream")]
pub struct PyMrcStream {
    pub(crate) inner: MrcStream,
}

#[pymethods]
impl PyMrcStream {
    /// `sample_threshold`: keys whose top 24 bits fall below it are recorded (2**24: all).
    #[new]
    fn new(
        py: Python<'_>,
        block_size: &Bound<'_, PyAny>,
        sample_threshold: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let bs = int_arg(block_size, "block_size", 1, 1 << 16)? as usize;
        let threshold = int_arg(sample_threshold, "sample_threshold", 1, 1 << 24)? as u64;
        let inner = MrcStream::new(bs, threshold).map_err(|e| stream_err(py, e))?;
        Ok(Self { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn prompt_tokens(&self) -> u64 {
        self.inner.prompt_tokens
    }

    #[getter]
    fn lookups(&self) -> u64 {
        self.inner.lookups
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// A sequence was allocated `token_ids` (chain root `root`: salt and LoRA id), the first
    /// `scheduled` scheduled.
    fn allocate(
        &mut self,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        scheduled: &Bound<'_, PyAny>,
        root: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let tokens = batch_tokens(token_ids)?;
        let scheduled = int_arg(scheduled, "scheduled", 0, tokens.len() as i64)? as usize;
        let root = u64_arg(root, "root")?;
        self.inner.allocate(id, &tokens, scheduled, root);
        Ok(())
    }

    fn extend(
        &mut self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let n = int_arg(num_new_tokens, "num_new_tokens", 0, i32::MAX.into())? as usize;
        self.inner.extend(id, n).map_err(|e| stream_err(py, e))
    }

    fn append(
        &mut self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let tokens = batch_tokens(token_ids)?;
        self.inner
            .append(id, &tokens)
            .map_err(|e| stream_err(py, e))
    }

    fn decode(
        &mut self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let tokens = batch_tokens(token_ids)?;
        if ids.len() != tokens.len() {
            return Err(invalid(
                py,
                format!("{} seq_ids but {} token_ids", ids.len(), tokens.len()),
            ));
        }
        self.inner
            .decode(&ids, &tokens)
            .map_err(|e| stream_err(py, e))
    }

    fn fork(
        &mut self,
        py: Python<'_>,
        parent_id: &Bound<'_, PyAny>,
        child_id: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let parent = seq_id(parent_id)?;
        let child = seq_id(child_id)?;
        self.inner
            .fork(parent, child)
            .map_err(|e| stream_err(py, e))
    }

    fn free(&mut self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        self.inner.free(id).map_err(|e| stream_err(py, e))
    }

    fn swap_out(&mut self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        self.inner.swap_out(id).map_err(|e| stream_err(py, e))
    }

    fn swap_in(&mut self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        self.inner.swap_in(id).map_err(|e| stream_err(py, e))
    }

    /// Hit blocks at each of `capacities` under `policy` (`lru`, `fifo`, `optimal`: Belady's
    /// bound under the prefix constraint), over the lookups from the `first_lookup`-th on.
    /// The stream must be exact (sampled keys leave the optimum without parents).
    fn hits(
        &self,
        py: Python<'_>,
        capacities: &Bound<'_, PyAny>,
        policy: &str,
        first_lookup: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        crate::block_replay::policy_hits(py, self.inner.stream(), capacities, policy, first_lookup)
    }

    /// `(thresholds, touches, distinct)`: every looked-up block's threshold (its prefix's
    /// largest stack distance, divided by `sample_rate`), ascending; the keys touched; the
    /// distinct keys touched.
    fn curve<'py>(
        &self,
        py: Python<'py>,
        sample_rate: f64,
    ) -> PyResult<(Bound<'py, PyArray1<f64>>, u64, u64)> {
        if !(sample_rate > 0.0 && sample_rate <= 1.0) {
            return Err(invalid(
                py,
                format!("sample_rate must be in (0, 1], got {sample_rate}"),
            ));
        }
        crate::numpy_api::numpy_api(py, "for a miss-ratio curve (an array)")?;
        let t = py.detach(|| self.inner.curve(sample_rate));
        Ok((t.values.into_pyarray(py), t.touches, t.distinct))
    }
}
