//! The Python binding of pagedkv-core: `pagedkv._core`.

mod block_replay;
mod convert;
mod deferred_apply;
mod deferred_decode;
mod deferred_run;
mod engine_record;
mod errors;
mod evicted;
mod manager;
mod mrc;
mod numpy_api;
mod objects;
mod retention;
mod router;
mod router_held;
mod router_keys;
mod running;
mod sched_loop;

use pyo3::prelude::*;

#[pymodule]
mod _core {
    use super::*;
    use crate::convert::{batch_tokens, int_arg, lora_arg, opt_u64_arg, text, Given};
    use crate::manager::{hash_algo_arg, salt_arg};
    use pagedkv_core::{encode_extras, BlockHasher};
    use pyo3::types::PyBytes;

    #[pymodule_export]
    use crate::manager::PyBlockManager;

    #[pymodule_export]
    use crate::running::PyRunningBatch;

    #[pymodule_export]
    use crate::engine_record::PyEngineRecord;

    #[pymodule_export]
    use crate::deferred_decode::PyDeferredDecodes;

    #[pymodule_export]
    use crate::mrc::PyMrcStream;

    #[pymodule_export]
    use crate::sched_loop::schedule_replay;

    #[pymodule_export]
    use crate::block_replay::PyBlockReplay;

    #[pymodule_export]
    use crate::router::PyRouterIndex;

    #[pymodule_export]
    use crate::router_held::PyHeldBlocks;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }

    /// The first `length` pseudo-tokens of a trace prompt given as hash ids, `block_tokens`
    /// per id (`pagedkv.sim.requests.hash_id_tokens`).
    #[pyfunction]
    fn trace_tokens<'py>(
        py: Python<'py>,
        hash_ids: &Bound<'py, PyAny>,
        length: &Bound<'py, PyAny>,
        block_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<u32>>> {
        use numpy::IntoPyArray;
        let ids = crate::convert::seq_ids(hash_ids)?;
        let length = int_arg(length, "length", 0, i32::MAX.into())? as usize;
        let block_tokens = int_arg(block_tokens, "block_tokens", 1, 1 << 20)? as usize;
        crate::numpy_api::numpy_api(py, "for trace_tokens (an array)")?;
        Ok(pagedkv_sim::hash_id_tokens(&ids, length, block_tokens).into_pyarray(py))
    }

    /// Chain digests of the full blocks of `token_ids` (docs/hashing.md).
    #[pyfunction]
    #[pyo3(
        signature = (token_ids, block_size, *, cache_salt=None, lora_id=None, hash_algo=Given::Absent, seed=Given::Absent),
        text_signature = "(token_ids, block_size, *, cache_salt=None, lora_id=None, hash_algo='sha256', seed=0)"
    )]
    fn hash_blocks<'py>(
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: &Bound<'py, PyAny>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_id: Option<&Bound<'py, PyAny>>,
        hash_algo: Given<'py>,
        seed: Given<'py>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        // In the arguments' order (docs/inputs.md). No tokens, no full block: no digests.
        let toks = batch_tokens(token_ids)?;
        let block_size = int_arg(block_size, "block_size", 1, 1 << 16)? as usize;
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let algo = hash_algo_arg(py, &text(&hash_algo, "sha256", "hash_algo")?)?;
        let seed = opt_u64_arg(&seed, 0, "seed")?;
        let extras = encode_extras(salt.as_deref(), lora);
        let digests = BlockHasher::new(algo, seed).hash_chain(&toks, block_size, &extras);
        Ok(digests
            .iter()
            .map(|d| PyBytes::new(py, d.as_bytes()))
            .collect())
    }
}
