//! `pagedkv._core.BlockReplay` (pagedkv-sim's `block_replay`: a pure cache replay of a trace's
//! hash ids at block granularity) and the per-size policy replays of a stream
//! (`policy_replay`), for `pagedkv.sim.mrc_blocks` and the optimal bound. Argument and result
//! conversion only.

use crate::convert::{int_arg, u64s};
use crate::errors::invalid;
use numpy::{IntoPyArray, PyArray1};
use pagedkv_sim::{block_stream, hits, Policy, Stream, TraceIds};
use pyo3::prelude::*;

/// `(thresholds, touches, distinct)` of `stack::thresholds`, as numpy and ints.
pub type Curve<'py> = (Bound<'py, PyArray1<f64>>, u64, u64);

/// Hit blocks at each of `capacities` under `policy` (`lru`, `fifo` or `optimal`), counting
/// the lookups from the `first_lookup`-th on.
pub fn policy_hits(
    py: Python<'_>,
    stream: &Stream,
    capacities: &Bound<'_, PyAny>,
    policy: &str,
    first_lookup: &Bound<'_, PyAny>,
) -> PyResult<Vec<u64>> {
    let Some(p) = Policy::parse(policy) else {
        return Err(invalid(
            py,
            format!("policy must be lru, fifo or optimal, got {policy:?}"),
        ));
    };
    let sizes = u64s(capacities, "capacities")?;
    let first = int_arg(first_lookup, "first_lookup", 0, i64::MAX)? as usize;
    let sizes: Vec<usize> = sizes
        .iter()
        .map(|&c| usize::try_from(c).unwrap_or(usize::MAX))
        .collect();
    Ok(py.detach(|| hits(stream, &sizes, p, first)))
}

/// A pure cache replay of a trace at block granularity: request `r` holds
/// `ids[offsets[r]:offsets[r + 1]]`, `lengths[r]` prompt tokens, chain root `roots[r]`.
#[pyclass(module = "pagedkv._core", name = "BlockReplay", frozen)]
pub struct PyBlockReplay {
    stream: Stream,
}

#[pymethods]
impl PyBlockReplay {
    #[new]
    fn new(
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        roots: &Bound<'_, PyAny>,
        id_tokens: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let ids = u64s(ids, "ids")?;
        let to_usize = |v: Vec<u64>| -> Vec<usize> {
            v.into_iter()
                .map(|x| usize::try_from(x).unwrap_or(usize::MAX))
                .collect()
        };
        let offsets = to_usize(u64s(offsets, "offsets")?);
        let lengths = to_usize(u64s(lengths, "lengths")?);
        let roots = u64s(roots, "roots")?;
        let id_tokens = int_arg(id_tokens, "id_tokens", 1, 1 << 20)? as usize;
        let block_size = int_arg(block_size, "block_size", 1, 1 << 20)? as usize;
        let trace = TraceIds {
            ids: &ids,
            offsets: &offsets,
            lengths: &lengths,
            roots: &roots,
            id_tokens,
        };
        let stream = py
            .detach(|| block_stream(&trace, block_size))
            .map_err(|e| invalid(py, e.to_string()))?;
        Ok(Self { stream })
    }

    #[getter]
    fn lookups(&self) -> usize {
        self.stream.lookups()
    }

    /// `(thresholds, touches, distinct)`: the LRU curve's thresholds of the lookups from the
    /// `first_lookup`-th on, ascending; the keys touched; the distinct keys touched.
    fn curve<'py>(
        &self,
        py: Python<'py>,
        first_lookup: &Bound<'py, PyAny>,
    ) -> PyResult<Curve<'py>> {
        let first = int_arg(first_lookup, "first_lookup", 0, i64::MAX)? as usize;
        crate::numpy_api::numpy_api(py, "for a miss-ratio curve (an array)")?;
        let s = &self.stream;
        let t = py.detach(|| pagedkv_sim::stack::thresholds(&s.keys, &s.pieces, 1.0, first));
        Ok((t.values.into_pyarray(py), t.touches, t.distinct))
    }

    /// Hit blocks at each of `capacities` under `policy` (`lru`, `fifo`, `optimal`).
    fn hits(
        &self,
        py: Python<'_>,
        capacities: &Bound<'_, PyAny>,
        policy: &str,
        first_lookup: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u64>> {
        policy_hits(py, &self.stream, capacities, policy, first_lookup)
    }
}
