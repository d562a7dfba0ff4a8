//! The Python binding of pagedkv-core: `pagedkv._core`.

mod convert;
mod errors;
mod manager;
mod objects;

use pyo3::prelude::*;

#[pymodule]
mod _core {
    use super::*;
    use crate::convert::tokens;
    use crate::errors::{invalid, IntoPy};
    use pagedkv_core::{encode_extras, BlockHasher, HashAlgo};
    use pyo3::types::{PyBytes, PyString};

    #[pymodule_export]
    use crate::manager::PyBlockManager;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }

    /// Chain digests of the full blocks of `token_ids` (docs/hashing.md).
    #[pyfunction]
    #[pyo3(signature = (token_ids, block_size, *, cache_salt=None, lora_id=None, hash_algo="sha256", seed=0))]
    fn hash_blocks<'py>(
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        block_size: usize,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_id: Option<u64>,
        hash_algo: &str,
        seed: u64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let toks = tokens(token_ids)?;
        if block_size == 0 {
            return Err(invalid(py, "block_size must be at least 1"));
        }
        let algo = HashAlgo::parse(hash_algo).ok_or_else(|| {
            invalid(
                py,
                format!("hash_algo must be 'sha256' or 'xxh3_128', got {hash_algo:?}"),
            )
        })?;
        let salt: Option<Vec<u8>> = match cache_salt {
            None => None,
            Some(o) => Some(if let Ok(s) = o.cast::<PyString>() {
                s.to_str()?.as_bytes().to_vec()
            } else if let Ok(b) = o.cast::<PyBytes>() {
                b.as_bytes().to_vec()
            } else {
                return Err(invalid(py, "cache_salt must be str, bytes or None"));
            }),
        };
        let extras = encode_extras(salt.as_deref(), lora_id);
        let digests = BlockHasher::new(algo, seed).hash_chain(&toks, block_size, &extras);
        let out: Result<_, pagedkv_core::Error> = Ok(digests
            .iter()
            .map(|d| PyBytes::new(py, d.as_bytes()))
            .collect());
        out.py(py)
    }
}
