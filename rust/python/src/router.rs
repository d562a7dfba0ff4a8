//! The binding of pagedkv-router: `pagedkv._core.RouterIndex` (the Python class
//! `pagedkv.router.RouterIndex` subclasses it and adds ranking and following streams).
//!
//! One class for the three key forms: the index behind it is chosen at construction
//! (`hash_form="int"`: vLLM's integer hashes; `"bytes"`: whole digests of the hash
//! algorithm's width). Payloads and lookups release the GIL while the index works.

use crate::convert::{batch_tokens, lora_arg, opt_int_arg, opt_u64_arg, text, wrong_type, Given};
use crate::errors::invalid;
use crate::manager::{hash_algo_arg, salt_arg};
use pagedkv_core::{encode_extras, BlockHasher};
use pagedkv_router::{
    Applied, BlockKey, Config, EngineKey, RawHit, RouterError, RouterIndex, Stats,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};
use std::sync::Arc;

/// Lookups of at least this many hashes release the GIL; shorter ones keep it. Releasing it
/// for a walk of microseconds hands the GIL to a waiting thread, which keeps it until the
/// switch interval (5 ms) asks for it back. `benches/test_bench_router.py::
/// test_lookup_threads` (64 engines, 1 M memberships, bytes; 2026-12-07): with the release
/// from 64 hashes, p99 beside a busy Python thread 5,180 us, beside a second lookup thread
/// 104 us; keeping the GIL, 5.3 to 7.0 and 3.9 to 5.6 us. From 4,096 hashes a walk takes
/// about 0.1 ms, long enough for another thread's turn.
const DETACH_AT: usize = 4096;

/// Token ids of at least this many blocks are hashed with the GIL released (as before the
/// lookups' threshold moved: hashing a block costs more than probing it).
const HASH_DETACH_BLOCKS: usize = 64;

/// Shared (`Arc`) with the threads that drop the blocks a snapshot replaced (`commit_snapshot`).
enum Inner {
    Int(Arc<RouterIndex<u64>>),
    D16(Arc<RouterIndex<[u8; 16]>>),
    D32(Arc<RouterIndex<[u8; 32]>>),
}

/// Run `$body` with `$ix` bound to the index, whatever its key form.
macro_rules! with_index {
    ($self:expr, $ix:ident => $body:expr) => {
        match &$self.inner {
            Inner::Int($ix) => $body,
            Inner::D16($ix) => $body,
            Inner::D32($ix) => $body,
        }
    };
}

static PAYLOAD_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

pub(crate) fn router_err(py: Python<'_>, e: RouterError) -> PyErr {
    match e {
        RouterError::Payload(_) | RouterError::HashForm(_) => {
            match PAYLOAD_ERROR.import(py, "pagedkv.errors", "KVEventPayloadError") {
                Ok(ty) => PyErr::from_type(ty.clone(), e.to_string()),
                Err(err) => err,
            }
        }
        _ => invalid(py, e.to_string()),
    }
}

/// An engine id: an int in [0, 2**64) or a str.
fn engine_arg(obj: &Bound<'_, PyAny>) -> PyResult<EngineKey> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(EngineKey::Name(s.to_str()?.into()));
    }
    if obj.cast::<PyInt>().is_ok() && !obj.is_instance_of::<pyo3::types::PyBool>() {
        return obj
            .extract::<u64>()
            .map(EngineKey::Int)
            .map_err(|_| invalid(obj.py(), "an int engine_id must be in [0, 2**64)"));
    }
    Err(wrong_type(
        obj.py(),
        format!(
            "engine_id must be an int or a str, got {}",
            obj.get_type().name()?
        ),
    ))
}

fn engine_obj<'py>(py: Python<'py>, e: &EngineKey) -> Bound<'py, PyAny> {
    match e {
        EngineKey::Int(i) => i.into_pyobject(py).expect("int").into_any(),
        EngineKey::Name(n) => PyString::new(py, n).into_any(),
    }
}

fn applied<'py>(py: Python<'py>, a: Applied) -> PyResult<Bound<'py, PyTuple>> {
    PyTuple::new(
        py,
        [
            a.stored,
            a.removed,
            a.duplicates,
            a.unknown_removals,
            a.orphans,
            a.cleared,
            a.unknown_events,
        ],
    )
}

/// Keys of a Python argument: ints, or bytes of the digest width.
trait PyKey: BlockKey {
    fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Self>>;
    fn from_digest(d: &[u8]) -> Self;
    fn to_py<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny>;
}

impl PyKey for u64 {
    fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Self>> {
        crate::router_keys::int_keys(obj)
    }

    /// vLLM's integer hash of a digest: its low 64 bits, big-endian.
    fn from_digest(d: &[u8]) -> Self {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[d.len() - 8..]);
        u64::from_be_bytes(b)
    }

    fn to_py<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.into_pyobject(py).expect("int").into_any()
    }
}

macro_rules! digest_py_key {
    ($n:expr) => {
        impl PyKey for [u8; $n] {
            fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Self>> {
                let py = obj.py();
                let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = obj.cast::<PyList>() {
                    l.iter().collect()
                } else if let Ok(t) = obj.cast::<PyTuple>() {
                    t.iter().collect()
                } else {
                    return Err(wrong_type(py, "block_hashes must be a list or tuple of bytes"));
                };
                items
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let b = b.cast::<PyBytes>().map_err(|_| {
                            wrong_type(py, format!("block_hashes[{i}] must be bytes in a digest index"))
                        })?;
                        <[u8; $n]>::try_from(b.as_bytes()).map_err(|_| {
                            invalid(py, format!(
                                "block_hashes[{i}] has {} bytes; this index holds {}-byte digests",
                                b.as_bytes().len(),
                                $n
                            ))
                        })
                    })
                    .collect()
            }

            fn from_digest(d: &[u8]) -> Self {
                d.try_into().expect("the algorithm's width")
            }

            fn to_py<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
                PyBytes::new(py, self).into_any()
            }
        }
    };
}

digest_py_key!(16);
digest_py_key!(32);

/// An exact index of which engine holds which KV blocks (docs/router.md).
#[pyclass(frozen, subclass, module = "pagedkv._core", name = "RouterIndex")]
pub struct PyRouterIndex {
    inner: Inner,
    block_size: usize,
    algo_name: String,
    hasher: BlockHasher,
    hash_form: &'static str,
}

impl PyRouterIndex {
    fn holders<'py, K: PyKey>(
        &self,
        py: Python<'py>,
        ix: &RouterIndex<K>,
        keys: &[K],
    ) -> PyResult<Bound<'py, PyList>> {
        let raw = self.walk(py, ix, keys);
        let out = PyList::empty(py);
        let mut failed = Ok(());
        ix.name_hits(&raw, |h, e| {
            if failed.is_err() {
                return;
            }
            let medium = match ix.medium_name(h.medium).flatten() {
                Some(m) => PyString::new(py, m).into_any(),
                None => py.None().into_bound(py),
            };
            failed = out.append((engine_obj(py, e), medium, h.group, h.blocks));
        });
        failed?;
        Ok(out)
    }

    /// `{engine_id: leading blocks held}` in `medium` and `group`, built here rather than
    /// from `holders`' tuples: one dict item per engine, nothing else made.
    fn scores_of<'py, K: PyKey>(
        &self,
        py: Python<'py>,
        ix: &RouterIndex<K>,
        keys: &[K],
        medium: Option<&str>,
        group: u16,
    ) -> PyResult<Bound<'py, PyDict>> {
        let raw = self.walk(py, ix, keys);
        let out = PyDict::new(py);
        let mut failed = Ok(());
        ix.name_hits(&raw, |h, e| {
            if failed.is_ok() && h.group == group && ix.medium_name(h.medium) == Some(medium) {
                failed = out.set_item(engine_obj(py, e), h.blocks);
            }
        });
        failed?;
        Ok(out)
    }

    /// The raw walk: with the GIL held for short requests, unless a shard's lock is taken
    /// (then again without it: no thread waits for a lock holding the GIL); released for long
    /// ones.
    fn walk<K: PyKey>(&self, py: Python<'_>, ix: &RouterIndex<K>, keys: &[K]) -> Vec<RawHit> {
        let mut raw: Vec<RawHit> = Vec::new();
        if keys.len() >= DETACH_AT || !ix.try_match_raw(keys, &mut raw) {
            py.detach(|| ix.match_raw(keys, &mut raw));
        }
        raw
    }

    fn token_keys<K: PyKey>(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<K>> {
        let toks = batch_tokens(token_ids)?;
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let extras = encode_extras(salt.as_deref(), lora);
        let hash = || {
            self.hasher
                .hash_chain(&toks, self.block_size, &extras)
                .iter()
                .map(|d| K::from_digest(d.as_bytes()))
                .collect()
        };
        Ok(if toks.len() >= HASH_DETACH_BLOCKS * self.block_size {
            py.detach(hash)
        } else {
            hash()
        })
    }
}

/// Drop what snapshots replaced on a thread of its own: a commit of a snapshot of 1 M blocks
/// over 1 M others returns without clearing the old ones' bits (36 ms more on the
/// benchmark machine); lookups already ignore them. If no thread can start, here.
fn drop_in_background<K: BlockKey>(ix: &Arc<RouterIndex<K>>) {
    let mine = Arc::clone(ix);
    let spawned = std::thread::Builder::new()
        .name("pagedkv-router-drop".into())
        .spawn(move || {
            mine.drop_replaced();
        });
    if spawned.is_err() {
        ix.drop_replaced();
    }
}

fn stats_dict<'py>(py: Python<'py>, s: Stats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("engines", s.engines)?;
    d.set_item("holders", s.holders)?;
    d.set_item("memberships", s.memberships)?;
    d.set_item("entries", s.entries)?;
    d.set_item("stored", s.stored)?;
    d.set_item("removed", s.removed)?;
    d.set_item("duplicates", s.duplicates)?;
    d.set_item("unknown_removals", s.unknown_removals)?;
    d.set_item("orphans", s.orphans)?;
    d.set_item("cleared", s.cleared)?;
    d.set_item("unknown_events", s.unknown_events)?;
    d.set_item("rejected_payloads", s.rejected_payloads)?;
    d.set_item("snapshots", s.snapshots)?;
    d.set_item("map_bytes", s.map_bytes)?;
    d.set_item("set_bytes", s.set_bytes)?;
    d.set_item("other_bytes", s.other_bytes)?;
    d.set_item("bytes", s.bytes())?;
    Ok(d)
}

#[pymethods]
impl PyRouterIndex {
    #[new]
    #[pyo3(
        signature = (*, block_size = Given::Absent, hash_algo = Given::Absent, hash_seed = Given::Absent, hash_form = Given::Absent, max_holders = Given::Absent),
        text_signature = "(*, block_size=16, hash_algo='sha256', hash_seed=0, hash_form='int', max_holders=4096)"
    )]
    fn new(
        py: Python<'_>,
        block_size: Given<'_>,
        hash_algo: Given<'_>,
        hash_seed: Given<'_>,
        hash_form: Given<'_>,
        max_holders: Given<'_>,
    ) -> PyResult<Self> {
        let block_size = opt_int_arg(&block_size, 16, "block_size", 1, 1 << 16)?;
        let algo_name = text(&hash_algo, "sha256", "hash_algo")?;
        let algo = hash_algo_arg(py, &algo_name)?;
        let hash_seed = opt_u64_arg(&hash_seed, 0, "hash_seed")?;
        let hash_form = text(&hash_form, "int", "hash_form")?;
        let max_holders = opt_int_arg(&max_holders, 4096, "max_holders", 1, 1 << 20)?;
        let config = Config {
            max_holders: max_holders as usize,
            ..Config::default()
        };
        let (inner, form) = match (hash_form.as_str(), algo.digest_len()) {
            ("int", _) => (Inner::Int(Arc::new(RouterIndex::new(config))), "int"),
            ("bytes", 16) => (Inner::D16(Arc::new(RouterIndex::new(config))), "bytes"),
            ("bytes", 32) => (Inner::D32(Arc::new(RouterIndex::new(config))), "bytes"),
            _ => {
                return Err(invalid(
                    py,
                    format!("hash_form must be 'int' or 'bytes', got {hash_form:?}"),
                ))
            }
        };
        Ok(Self {
            inner,
            block_size: block_size as usize,
            algo_name,
            hasher: BlockHasher::new(algo, hash_seed),
            hash_form: form,
        })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[getter]
    fn hash_algo(&self) -> &str {
        &self.algo_name
    }

    #[getter]
    fn hash_form(&self) -> &'static str {
        self.hash_form
    }

    /// Apply one vLLM `KVEventBatch` payload (msgpack bytes as they come off the wire) to
    /// `engine_id`. Returns (stored, removed, duplicates, unknown_removals, orphans,
    /// cleared, unknown_events). A payload that does not decode raises
    /// `KVEventPayloadError` and changes nothing.
    fn apply<'py>(
        &self,
        py: Python<'py>,
        engine_id: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyBytes>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let e = engine_arg(engine_id)?;
        let bytes = payload.as_bytes();
        let r = py.detach(|| with_index!(self, ix => ix.apply_payload(&e, bytes)));
        applied(py, r.map_err(|err| router_err(py, err))?)
    }

    /// Start a snapshot of `engine_id` (`apply_staged`, then `commit_snapshot`).
    fn begin_snapshot(&self, engine_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let e = engine_arg(engine_id)?;
        with_index!(self, ix => ix.begin_snapshot(&e));
        Ok(())
    }

    /// Apply one payload to the snapshot begun for `engine_id`.
    fn apply_staged<'py>(
        &self,
        py: Python<'py>,
        engine_id: &Bound<'py, PyAny>,
        payload: &Bound<'py, PyBytes>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let e = engine_arg(engine_id)?;
        let bytes = payload.as_bytes();
        let r = py.detach(|| with_index!(self, ix => ix.apply_staged_payload(&e, bytes)));
        applied(py, r.map_err(|err| router_err(py, err))?)
    }

    /// The snapshot becomes `engine_id`'s blocks. The blocks it replaced stop counting at
    /// once and are dropped on a thread of their own (`drop_replaced` waits for it).
    fn commit_snapshot(&self, py: Python<'_>, engine_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let e = engine_arg(engine_id)?;
        let replaced = py
            .detach(|| with_index!(self, ix => ix.commit_snapshot_deferred(&e)))
            .map_err(|err| router_err(py, err))?;
        if replaced > 0 {
            with_index!(self, ix => drop_in_background(ix));
        }
        Ok(())
    }

    /// Drop the blocks snapshots replaced that are still queued, waiting for a drop already
    /// under way; returns how many holders it dropped itself.
    fn drop_replaced(&self, py: Python<'_>) -> usize {
        py.detach(|| with_index!(self, ix => ix.drop_replaced()))
    }

    fn abort_snapshot(&self, py: Python<'_>, engine_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let e = engine_arg(engine_id)?;
        py.detach(|| with_index!(self, ix => ix.abort_snapshot(&e)));
        Ok(())
    }

    /// Drop every block of `engine_id` at once; False if it was not known.
    fn remove_engine(&self, py: Python<'_>, engine_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let e = engine_arg(engine_id)?;
        Ok(py.detach(|| with_index!(self, ix => ix.remove_engine(&e))))
    }

    /// Every holder that holds the first of `block_hashes`: a list of
    /// (engine_id, medium, group, leading blocks held), in no particular order.
    fn match_hashes<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        with_index!(self, ix => {
            let keys = PyKey::keys(block_hashes)?;
            self.holders(py, ix, &keys)
        })
    }

    /// Leading blocks held per engine in `medium` and `group`, for the engines holding the
    /// first of `block_hashes` there: `{engine_id: blocks}` (the shape of Dynamo's
    /// `OverlapScores.scores`). The cheapest answer from Python: see `router_keys.rs` for the
    /// forms of `block_hashes` read fastest.
    #[pyo3(
        signature = (block_hashes, *, medium = Some("GPU".to_owned()), group = 0),
        text_signature = "(self, /, block_hashes, *, medium='GPU', group=0)"
    )]
    fn scores<'py>(
        &self,
        py: Python<'py>,
        block_hashes: &Bound<'py, PyAny>,
        medium: Option<String>,
        group: u16,
    ) -> PyResult<Bound<'py, PyDict>> {
        with_index!(self, ix => {
            let keys = PyKey::keys(block_hashes)?;
            self.scores_of(py, ix, &keys, medium.as_deref(), group)
        })
    }

    /// `match_hashes` of the block hashes of `token_ids` under the index's hash settings.
    #[pyo3(signature = (token_ids, *, cache_salt = None, lora_id = None))]
    fn match_tokens<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_id: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        with_index!(self, ix => {
            let keys = self.token_keys(py, token_ids, cache_salt, lora_id)?;
            self.holders(py, ix, &keys)
        })
    }

    /// The block hashes of `token_ids` as this index keys them (ints, or digests).
    #[pyo3(signature = (token_ids, *, cache_salt = None, lora_id = None))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_id: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyList>> {
        fn listed<'py, K: PyKey>(
            py: Python<'py>,
            _: &RouterIndex<K>,
            keys: Vec<K>,
        ) -> PyResult<Bound<'py, PyList>> {
            PyList::new(py, keys.iter().map(|k| k.to_py(py)))
        }
        with_index!(self, ix => {
            let keys = self.token_keys(py, token_ids, cache_salt, lora_id)?;
            listed(py, ix, keys)
        })
    }

    /// The engines known.
    fn engines<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut keys = with_index!(self, ix => ix.engines());
        keys.sort();
        PyList::new(py, keys.iter().map(|e| engine_obj(py, e)))
    }

    /// Blocks `engine_id` holds: a list of (medium, group, blocks).
    fn holder_sizes<'py>(
        &self,
        py: Python<'py>,
        engine_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let e = engine_arg(engine_id)?;
        let sizes = with_index!(self, ix => ix.holder_sizes(&e));
        PyList::new(py, sizes)
    }

    /// The block hashes `engine_id` holds in `medium` and `group`, as a set.
    #[pyo3(
        signature = (engine_id, medium = Some("GPU".to_owned()), group = 0),
        text_signature = "(self, /, engine_id, medium='GPU', group=0)"
    )]
    fn blocks<'py>(
        &self,
        py: Python<'py>,
        engine_id: &Bound<'py, PyAny>,
        medium: Option<String>,
        group: u16,
    ) -> PyResult<Bound<'py, pyo3::types::PySet>> {
        let e = engine_arg(engine_id)?;
        let set = pyo3::types::PySet::empty(py)?;
        with_index!(self, ix => {
            for k in ix.blocks_of(&e, medium.as_deref(), group) {
                set.add(k.to_py(py))?;
            }
        });
        Ok(set)
    }

    /// Counters and memory (a dict; `pagedkv.router.RouterStats` names its fields).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| with_index!(self, ix => ix.stats()));
        stats_dict(py, s)
    }

    /// Check the index's internal invariants (a full walk; `InvariantError` if broken).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| with_index!(self, ix => ix.check_invariants()))
            .map_err(|msg| crate::errors::to_pyerr(py, pagedkv_core::Error::Invariant(msg)))
    }
}
