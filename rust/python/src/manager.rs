//! `pagedkv._core.BlockManager`: a frozen pyclass over the core manager. Argument
//! conversion and result conversion only; every decision is the core's.

use crate::convert::{
    batch_tokens, block_ids, counts, flag, id_arg, int_arg, is_count, keys_arg, loaded_arg,
    lookaheads, lora_arg, max_hit_arg, maybe_seq_id, opt_int_arg, opt_u64_arg, positions, seq_id,
    seq_ids, text, token_count, tokens, wrong_type, Given,
};
use crate::errors::{invalid, IntoPy};
use crate::numpy_api::numpy_api;
use crate::objects;
use crate::retention::retention_arg;
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use pagedkv_core::{
    duties, nonblocking, AllocateOpts, BlockManager, Config, Error, EvictionKind, GroupKind,
    HashAlgo, PromptKeys, PromptLen, Quota, Result as CoreResult,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

/// Batches at least this long release the GIL while the core works: below it, detaching
/// costs more than the work.
const DETACH_MIN_BATCH: usize = 64;
/// Prompts at least this long release the GIL while they are hashed.
const DETACH_MIN_TOKENS: usize = 4096;
/// Pools at least this large release the GIL while their tables are built.
const DETACH_MIN_BLOCKS: u32 = 1 << 20;

/// Run a core call. With `detach` (work that grows with the input) the GIL is released for
/// the whole call. Otherwise the call runs with the GIL held in non-blocking mode, and only
/// if it would wait for a lock (having changed nothing) runs again with the GIL released:
/// no thread ever waits for a sequence lock or the reset gate while holding the GIL.
fn run<T: Send>(
    py: Python<'_>,
    detach: bool,
    mut call: impl FnMut() -> CoreResult<T> + Send,
) -> PyResult<T> {
    let out = if detach {
        py.detach(&mut call)
    } else {
        match nonblocking(&mut call) {
            Err(Error::WouldBlock) => py.detach(&mut call),
            other => other,
        }
    };
    out.py(py)
}

type Pairs = Vec<(u32, u32)>;

/// The `evicted=` argument of a call that takes blocks: a list the call appends its own
/// evictions to, or None. Checked first, before the call's other arguments (as the
/// reference model does; docs/inputs.md), so a bad one changes nothing.
pub(crate) fn evicted_arg<'py>(
    obj: Option<&Bound<'py, PyAny>>,
    records: bool,
) -> PyResult<Option<Bound<'py, PyList>>> {
    let Some(obj) = obj else { return Ok(None) };
    let list = obj
        .cast::<PyList>()
        .map_err(|_| wrong_type(obj.py(), "evicted must be a list or None"))?;
    if !records {
        return Err(invalid(
            obj.py(),
            "evicted= needs a manager built with record_evictions=True",
        ));
    }
    Ok(Some(list.clone()))
}

/// `run` for a call that may evict cached blocks: with `evicted`, the evictions the call
/// made (on this thread: `duties::capture`) are appended to it as `(block, group, digest)`
/// before the call returns or raises, so the caller owns exactly its own duties; none is
/// lost if an append fails (`evicted::deliver`).
pub(crate) fn run_evicting<'py, T: Send + IntoPyObject<'py>>(
    py: Python<'py>,
    detach: bool,
    evicted: Option<&Bound<'py, PyList>>,
    call: impl FnMut() -> CoreResult<T> + Send,
) -> PyResult<T> {
    let Some(list) = evicted else {
        return run(py, detach, call);
    };
    let (out, taken) = duties::capture(|| run(py, detach, call));
    crate::evicted::deliver(py, list, taken, out)
}

/// `lookahead`: slots past the new tokens, `>= 0` (no bound but the pool).
fn lookahead_arg(obj: &Given<'_>) -> PyResult<usize> {
    Ok(opt_int_arg(obj, 0, "lookahead", 0, i64::MAX)? as usize)
}

/// `num_new_tokens` of a prompt: None (all of it) or an int `>= 1` (whether it fits the
/// prompt is the core's check).
fn new_tokens_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    obj.map(|k| int_arg(k, "num_new_tokens", 1, i64::MAX).map(|k| k as usize))
        .transpose()
}

/// `group`: a non-negative int naming a group (whether it exists is the core's check).
fn group_arg(obj: &Given<'_>) -> PyResult<usize> {
    Ok(opt_int_arg(obj, 0, "group", 0, i64::from(u8::MAX))? as usize)
}

/// The `groups=` list, validated by `pagedkv.groups.check_groups` (one place for the rules
/// and messages, shared with the reference model), as core group kinds.
fn groups_arg(
    py: Python<'_>,
    groups: &Bound<'_, PyAny>,
    block_size: usize,
) -> PyResult<Vec<GroupKind>> {
    let checked = py
        .import("pagedkv.groups")?
        .getattr("check_groups")?
        .call1((groups, block_size))?;
    let mut kinds = Vec::new();
    for g in checked.try_iter()? {
        let g = g?;
        let kind: String = g.getattr("kind")?.extract()?;
        let window: Option<usize> = g.getattr("window")?.extract()?;
        let chunk: Option<usize> = g.getattr("chunk")?.extract()?;
        kinds.push(GroupKind::parse(&kind, window, chunk, block_size).py(py)?);
    }
    Ok(kinds)
}

/// Paged KV-cache block manager (the Rust core): `num_blocks` GPU blocks of `block_size`
/// tokens, `num_cpu_blocks` CPU swap blocks, a hashed prefix cache; `groups=` for hybrid
/// models (one block table per KV-cache group). Safe to call from many threads at once.
/// The contract: docs/semantics.md.
#[pyclass(frozen, subclass, module = "pagedkv._core", name = "BlockManager")]
pub struct PyBlockManager {
    pub(crate) inner: BlockManager,
}

impl PyBlockManager {
    /// Whether the manager was built with `record_evictions` (what `evicted=` needs).
    pub(crate) fn records(&self) -> bool {
        self.inner.config().record_evictions
    }

    /// Events taken from the log are handed on only if their conversion succeeded;
    /// otherwise the log is told they were lost, so the consumer resyncs instead of
    /// silently missing them.
    fn handed_on<'py>(
        &self,
        converted: PyResult<Vec<Bound<'py, PyAny>>>,
        taken: usize,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        if converted.is_err() {
            self.inner.kv_events_lost(taken);
        }
        converted
    }
}

fn salt_bytes(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    let Some(obj) = obj else { return Ok(None) };
    if let Ok(s) = obj.cast::<PyString>() {
        let text = s
            .to_str()
            .map_err(|_| invalid(obj.py(), "cache_salt is not valid UTF-8 text"))?;
        return Ok(Some(text.as_bytes().to_vec()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Some(b.as_bytes().to_vec()));
    }
    Err(wrong_type(
        obj.py(),
        "cache_salt must be str, bytes or None",
    ))
}

/// Parse `hash_algo`.
pub fn hash_algo_arg(py: Python<'_>, name: &str) -> PyResult<HashAlgo> {
    HashAlgo::parse(name).ok_or_else(|| {
        invalid(
            py,
            format!("hash_algo must be 'sha256' or 'xxh3_128', got {name:?}"),
        )
    })
}

/// Parse `eviction`: one of the policy names.
pub fn eviction_arg(py: Python<'_>, name: &str) -> PyResult<EvictionKind> {
    EvictionKind::from_name(name).ok_or_else(|| {
        let names: Vec<&str> = EvictionKind::ALL.iter().map(|k| k.name()).collect();
        invalid(
            py,
            format!("eviction must be one of {}, got {name:?}", names.join(", ")),
        )
    })
}

/// Parse `cache_salt`: str (as UTF-8), bytes, or None.
pub fn salt_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    salt_bytes(obj)
}

pub(crate) fn pairs_array(py: Python<'_>, pairs: Pairs) -> PyResult<Bound<'_, PyArray2<i32>>> {
    // The callers that change state checked numpy before they did (`numpy_api` is then a
    // load of a flag); never a panic here either way.
    numpy_api(py, "for the copy pairs (an array)")?;
    let flat: Vec<i32> = pairs
        .iter()
        .flat_map(|&(a, b)| [a as i32, b as i32])
        .collect();
    let array = Array2::from_shape_vec((pairs.len(), 2), flat)
        .map_err(|e| invalid(py, format!("internal shape error: {e}")))?;
    Ok(array.into_pyarray(py))
}

#[pymethods]
impl PyBlockManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size=Given::Absent, *, num_cpu_blocks=Given::Absent,
            enable_prefix_caching=Given::Absent, hash_algo=Given::Absent, hash_seed=Given::Absent,
            watermark=Given::Absent, enable_kv_events=Given::Absent,
            record_evictions=Given::Absent, eviction=Given::Absent, tenants=Given::Absent,
            groups=None, prefix_cache_retention_interval=None),
        text_signature = "(num_blocks, block_size=16, *, num_cpu_blocks=0, \
            enable_prefix_caching=True, hash_algo='sha256', hash_seed=0, watermark=0.01, \
            enable_kv_events=False, record_evictions=False, eviction='lru', tenants=False, \
            groups=None, prefix_cache_retention_interval=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: Given<'_>,
        num_cpu_blocks: Given<'_>,
        enable_prefix_caching: Given<'_>,
        hash_algo: Given<'_>,
        hash_seed: Given<'_>,
        watermark: Given<'_>,
        enable_kv_events: Given<'_>,
        record_evictions: Given<'_>,
        eviction: Given<'_>,
        tenants: Given<'_>,
        groups: Option<&Bound<'_, PyAny>>,
        prefix_cache_retention_interval: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let max = i64::from(i32::MAX);
        // Struct fields are evaluated in order: the arguments' order (docs/inputs.md).
        let config = Config {
            num_blocks: int_arg(num_blocks, "num_blocks", 1, max)? as u32,
            block_size: opt_int_arg(&block_size, 16, "block_size", 1, 1 << 16)? as usize,
            num_cpu_blocks: opt_int_arg(&num_cpu_blocks, 0, "num_cpu_blocks", 0, max)? as u32,
            enable_prefix_caching: flag(&enable_prefix_caching, true, "enable_prefix_caching")?,
            hash_algo: hash_algo_arg(py, &text(&hash_algo, "sha256", "hash_algo")?)?,
            hash_seed: opt_u64_arg(&hash_seed, 0, "hash_seed")?,
            watermark: crate::convert::watermark(&watermark)?,
            enable_kv_events: flag(&enable_kv_events, false, "enable_kv_events")?,
            record_evictions: flag(&record_evictions, false, "record_evictions")?,
            eviction: eviction_arg(py, &text(&eviction, "lru", "eviction")?)?,
            tenants: flag(&tenants, false, "tenants")?,
            prefix_cache_retention_interval: prefix_cache_retention_interval
                .filter(|o| !o.is_none())
                .map(|o| int_arg(o, "prefix_cache_retention_interval", 0, max))
                .transpose()?
                .map(|v| v as usize),
        };
        let kinds = groups
            .map(|g| groups_arg(py, g, config.block_size))
            .transpose()?;
        let detach = config.num_blocks >= DETACH_MIN_BLOCKS;
        let build = move || match kinds {
            None => BlockManager::new(config),
            Some(kinds) => BlockManager::with_groups(config, kinds),
        };
        let inner = if detach { py.detach(build) } else { build() };
        Ok(Self {
            inner: inner.py(py)?,
        })
    }

    /// Give a new sequence its blocks: the cached prefix it hits plus `num_new_tokens`
    /// prompt tokens (default all of them), and `lookahead` draft slots past those.
    ///
    /// Returns the prompt tokens served from the prefix cache (a multiple of `block_size`, at
    /// most `len(token_ids) - 1`), or None if the blocks do not fit (nothing changed). Full
    /// blocks are registered in the prefix cache once scheduled. Tokens: a list, tuple, range or
    /// 1-D integer array. `cache_salt` (str or bytes) and `lora_id` keep prefixes apart.
    /// `evicted` (with `record_evictions=True`): a list this call appends the `(block, group,
    /// digest)` of each cached block IT evicted to, before it returns or raises; copy those
    /// out before device work writes them (the other block-taking calls take it too).
    /// `block_hashes`: the caller's keys of the prompt's full blocks (a list or tuple of 1..=128
    /// byte strings, chain keys such as vLLM's block hashes): the sequence is then keyed by them,
    /// never by its tokens. `max_hit_tokens`: the hit takes at most that many tokens' blocks.
    /// `register=False`: the blocks scheduled past the hit are registered only by `register`.
    /// `retention` (eviction="priority"): `[(start_token, end_token or None, priority,
    /// duration_s or None), ...]`, TensorRT-LLM's token-range retention; `decode_retention`:
    /// `(priority, duration_s or None)` for the blocks past the prompt (docs/eviction.md).
    /// `loaded_tokens`: how many of the tokens scheduled right after the hit have KV loaded
    /// from outside the cache (a connector's load), not computed: a group that skips leading
    /// tokens (a state or window group) then needs only the hit blocks it reads past them, so
    /// a state group whose state arrives with the load takes none of the hit and the hit may
    /// run as deep as the full-attention groups' (docs/semantics.md, "Loaded tokens").
    /// `reachable_tokens` (with `prefix_cache_retention_interval` not None): the token
    /// positions, at most the prompt's length, where a later hit can resume; the window groups
    /// cache the blocks a hit there reads (default: the prompt less one token;
    /// docs/semantics.md, "Window retention").
    #[pyo3(
        signature = (seq_id, token_ids, *, num_new_tokens=None, cache_salt=None, lora_id=None,
            lookahead=Given::Absent, evicted=None, block_hashes=None, max_hit_tokens=None,
            register=Given::Absent, retention=None, decode_retention=None, loaded_tokens=None,
            reachable_tokens=None),
        text_signature = "($self, seq_id, token_ids, *, num_new_tokens=None, cache_salt=None, \
            lora_id=None, lookahead=0, evicted=None, block_hashes=None, max_hit_tokens=None, \
            register=True, retention=None, decode_retention=None, loaded_tokens=0, \
            reachable_tokens=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allocate(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
        lookahead: Given<'_>,
        evicted: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_hit_tokens: Option<&Bound<'_, PyAny>>,
        register: Given<'_>,
        retention: Option<&Bound<'_, PyAny>>,
        decode_retention: Option<&Bound<'_, PyAny>>,
        loaded_tokens: Option<&Bound<'_, PyAny>>,
        reachable_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<usize>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let id = self::seq_id(seq_id)?;
        let toks = tokens(token_ids)?;
        let new = new_tokens_arg(num_new_tokens)?;
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let lookahead = lookahead_arg(&lookahead)?;
        let keys = keys_arg(block_hashes)?;
        let cap = max_hit_arg(max_hit_tokens)?;
        let register = flag(&register, true, "register")?;
        let retention = retention_arg(py, retention, decode_retention)?;
        let reachable = reachable_tokens
            .filter(|o| !o.is_none())
            .map(|o| positions(o, "reachable_tokens"))
            .transpose()?;
        let detach = toks.len() >= DETACH_MIN_TOKENS;
        let mut toks = toks;
        let opts = AllocateOpts {
            keys: PromptKeys {
                cache_salt: salt.as_deref(),
                lora_id: lora,
                block_hashes: keys.as_deref(),
                max_hit_tokens: cap,
                loaded_tokens: loaded_arg(loaded_tokens)?,
            },
            num_new_tokens: new,
            lookahead,
            register,
            retention: retention.as_ref(),
            reachable: reachable.as_deref(),
        };
        // The converted tokens move into the core on success: no second copy of a prompt.
        run_evicting(py, detach, evicted.as_ref(), || {
            self.inner.allocate_with(id, &mut toks, &opts)
        })
    }

    /// Schedule the next `num_new_tokens` tokens of the prompt (chunked prefill).
    ///
    /// Returns the copy-on-write `(src, dst)` block pairs to copy before the step, or None if
    /// the blocks do not fit (nothing changed). `evicted`: as `allocate`'s. `release=False`:
    /// the entries the groups no longer need stay (`release_skipped` releases them).
    #[pyo3(
        signature = (seq_id, num_new_tokens, *, lookahead=Given::Absent, evicted=None,
            release=Given::Absent),
        text_signature = "($self, seq_id, num_new_tokens, *, lookahead=0, evicted=None, \
            release=True)"
    )]
    fn extend(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_new_tokens: &Bound<'_, PyAny>,
        lookahead: Given<'_>,
        evicted: Option<&Bound<'_, PyAny>>,
        release: Given<'_>,
    ) -> PyResult<Option<Pairs>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let id = self::seq_id(seq_id)?;
        let k = int_arg(num_new_tokens, "num_new_tokens", 1, i64::MAX)? as usize;
        let lookahead = lookahead_arg(&lookahead)?;
        let release = flag(&release, true, "release")?;
        run_evicting(py, false, evicted.as_ref(), || {
            self.inner.extend_releasing(id, k, lookahead, release)
        })
    }

    /// Append generated tokens to a fully scheduled sequence, and reserve `lookahead`
    /// draft slots past them (speculative decoding).
    ///
    /// Returns the copy-on-write `(src, dst)` block pairs to copy before the step, or None if
    /// the blocks do not fit (nothing changed). Blocks that become full are registered.
    /// `evicted`: as `allocate`'s. `token_ids` may be empty with `lookahead > 0` (slots only)
    /// or with `block_hashes` (keys only). `block_hashes`: a caller-keyed sequence's further
    /// keys, continuing its list (at most one per full block). `release`: as `extend`'s.
    #[pyo3(
        signature = (seq_id, token_ids, *, lookahead=Given::Absent, evicted=None,
            block_hashes=None, release=Given::Absent),
        text_signature = "($self, seq_id, token_ids, *, lookahead=0, evicted=None, \
            block_hashes=None, release=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        lookahead: Given<'_>,
        evicted: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        release: Given<'_>,
    ) -> PyResult<Option<Pairs>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let id = self::seq_id(seq_id)?;
        let toks = batch_tokens(token_ids)?;
        let lookahead = lookahead_arg(&lookahead)?;
        let keys = keys_arg(block_hashes)?;
        let release = flag(&release, true, "release")?;
        run_evicting(
            py,
            toks.len() >= DETACH_MIN_TOKENS,
            evicted.as_ref(),
            || {
                self.inner
                    .append_releasing(id, &toks, lookahead, keys.as_deref(), release)
            },
        )
    }

    /// Release the entries each group no longer needs when the sequence's next position
    /// is `num_tokens` (at most its scheduled tokens), group by group, tail first: what a
    /// step releases first, for a caller that steps with `release=False` (vLLM's
    /// `remove_skipped_blocks`). Never refused. Returns the entries released.
    #[pyo3(signature = (seq_id, num_tokens), text_signature = "($self, seq_id, num_tokens)")]
    fn release_skipped(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        let n = int_arg(num_tokens, "num_tokens", 0, i64::MAX)? as usize;
        run(py, false, || self.inner.release_skipped(id, n))
    }

    /// Register the sequence's blocks that are full of scheduled tokens and keyed, below
    /// `num_tokens` (default: every scheduled token), after adding `block_hashes` (a
    /// caller-keyed sequence's further keys), and lift its hold (`register=False`) up to
    /// there (`num_tokens=None`: lift it). Returns how many blocks this call newly
    /// registered.
    #[pyo3(
        signature = (seq_id, *, num_tokens=None, block_hashes=None),
        text_signature = "($self, seq_id, *, num_tokens=None, block_hashes=None)"
    )]
    fn register(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        let n = num_tokens
            .map(|t| int_arg(t, "num_tokens", 0, i64::MAX).map(|t| t as usize))
            .transpose()?;
        let keys = keys_arg(block_hashes)?;
        run(py, false, || self.inner.register(id, n, keys.as_deref()))
    }

    /// Drop every token past `num_tokens` (rejected drafts, roll-back) and give back
    /// the blocks only they used.
    ///
    /// Returns the copy-on-write `(src, dst)` pairs (a shared partial last block is copied), or
    /// None if that copy does not fit (nothing changed). `evicted`: as `allocate`'s.
    #[pyo3(
        signature = (seq_id, num_tokens, *, evicted=None),
        text_signature = "($self, seq_id, num_tokens, *, evicted=None)"
    )]
    fn truncate(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        evicted: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Pairs>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let id = self::seq_id(seq_id)?;
        let m = int_arg(num_tokens, "num_tokens", 1, i64::MAX)? as usize;
        run_evicting(py, false, evicted.as_ref(), || self.inner.truncate(id, m))
    }

    /// Prompt tokens `allocate` would serve from the prefix cache now.
    ///
    /// Changes nothing: no LRU order, statistics or events. `block_hashes` and
    /// `max_hit_tokens`: as `allocate`'s.
    #[pyo3(
        signature = (token_ids, *, cache_salt=None, lora_id=None, block_hashes=None,
            max_hit_tokens=None, loaded_tokens=None),
        text_signature = "($self, token_ids, *, cache_salt=None, lora_id=None, \
            block_hashes=None, max_hit_tokens=None, loaded_tokens=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_hit_tokens: Option<&Bound<'_, PyAny>>,
        loaded_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let toks = tokens(token_ids)?;
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let keys = keys_arg(block_hashes)?;
        let cap = max_hit_arg(max_hit_tokens)?;
        let q = PromptKeys {
            cache_salt: salt.as_deref(),
            lora_id: lora,
            block_hashes: keys.as_deref(),
            max_hit_tokens: cap,
            loaded_tokens: loaded_arg(loaded_tokens)?,
        };
        run(py, toks.len() >= DETACH_MIN_TOKENS, || {
            self.inner.lookup_with(&toks, &q)
        })
    }

    /// Make `child_id` a copy of `parent_id` sharing every block (parallel sampling,
    /// beam search); later writes to a shared block are copied on write. Never runs out of
    /// blocks (so `evicted`, accepted like every block-taking call's, stays empty).
    #[pyo3(
        signature = (parent_id, child_id, *, evicted=None),
        text_signature = "($self, parent_id, child_id, *, evicted=None)"
    )]
    fn fork(
        &self,
        py: Python<'_>,
        parent_id: &Bound<'_, PyAny>,
        child_id: &Bound<'_, PyAny>,
        evicted: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let evicted = evicted_arg(evicted, self.records())?;
        let (p, c) = (
            id_arg(parent_id, "parent_id")?,
            id_arg(child_id, "child_id")?,
        );
        run_evicting(py, false, evicted.as_ref(), || self.inner.fork(p, c))
    }

    /// Release the sequence's blocks, tail first, and forget it. Registered blocks stay
    /// cached for later prefix hits.
    ///
    /// `num_computed_tokens`: how many tokens really have KV (a scheduled step that never ran);
    /// blocks past it that this sequence registered leave the prefix cache.
    #[pyo3(
        signature = (seq_id, *, num_computed_tokens=None),
        text_signature = "($self, seq_id, *, num_computed_tokens=None)"
    )]
    fn free(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        num_computed_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let computed = num_computed_tokens
            .map(|c| int_arg(c, "num_computed_tokens", 0, i64::MAX).map(|c| c as usize))
            .transpose()?;
        run(py, false, || self.inner.free_computed(id, computed))
    }

    /// Pin every GPU block the sequence holds now: never evicted, kept in the prefix cache
    /// after it is freed, outside what admission counts on (docs/eviction.md, "Pins").
    /// Returns how many blocks it holds.
    #[pyo3(text_signature = "($self, seq_id)")]
    fn pin(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.pin(id))
    }

    /// Unpin every GPU block the sequence holds now (whoever pinned it). Returns how many.
    #[pyo3(text_signature = "($self, seq_id)")]
    fn unpin(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.unpin(id))
    }

    /// Make the manager's clock manual at `t` seconds (retention durations count against
    /// it); from then on it moves only by `set_time`, never back.
    fn set_time(&self, py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = crate::convert::float_arg(t, "t")?;
        self.inner.set_time(t).py(py)
    }

    /// The manager's clock, in seconds (monotonic until `set_time`).
    fn now(&self) -> f64 {
        self.inner.now()
    }

    /// CACHED blocks that are pinned now (held ones are counted when released).
    fn num_pinned_cached(&self) -> usize {
        self.inner.num_pinned_cached()
    }

    /// Move a sequence to CPU swap blocks.
    ///
    /// Returns the `(gpu, cpu)` block pairs to copy before any later device work, or None if the
    /// swap space is full (nothing changed).
    fn swap_out(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Option<Pairs>> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.swap_out(id))
    }

    /// Move a swapped-out sequence back to GPU blocks.
    ///
    /// Returns the `(cpu, gpu)` block pairs to copy, or None if the GPU blocks do not fit
    /// (nothing changed). `evicted`: as `allocate`'s.
    #[pyo3(
        signature = (seq_id, *, evicted=None),
        text_signature = "($self, seq_id, *, evicted=None)"
    )]
    fn swap_in(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        evicted: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Pairs>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let id = self::seq_id(seq_id)?;
        run_evicting(py, false, evicted.as_ref(), || self.inner.swap_in(id))
    }

    /// Whether a prompt fits now: `AllocStatus.OK`, `LATER` (not now, keeping the
    /// watermark free) or `NEVER` (not even in an empty pool).
    ///
    /// `num_tokens`: the prompt's length, or its token ids (then its cached prefix counts, with
    /// `cache_salt` and `lora_id`). `num_new_tokens`: the first chunk only. `block_hashes`
    /// (then its cached prefix counts, with a length too) and `max_hit_tokens`: as
    /// `allocate`'s. Changes nothing.
    #[pyo3(
        signature = (num_tokens, *, num_new_tokens=None, cache_salt=None, lora_id=None,
            block_hashes=None, max_hit_tokens=None, loaded_tokens=None),
        text_signature = "($self, num_tokens, *, num_new_tokens=None, cache_salt=None, \
            lora_id=None, block_hashes=None, max_hit_tokens=None, loaded_tokens=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn can_allocate<'py>(
        &self,
        py: Python<'py>,
        num_tokens: &Bound<'py, PyAny>,
        num_new_tokens: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_id: Option<&Bound<'py, PyAny>>,
        block_hashes: Option<&Bound<'py, PyAny>>,
        max_hit_tokens: Option<&Bound<'py, PyAny>>,
        loaded_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // A count (an int), or the prompt itself (token ids): then its cached prefix counts.
        let (count, toks) = if is_count(num_tokens) {
            (token_count(num_tokens)? as u64, None)
        } else {
            (0, Some(tokens(num_tokens)?))
        };
        let new = new_tokens_arg(num_new_tokens)?.map(|k| k as u64);
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let keys = keys_arg(block_hashes)?;
        let cap = max_hit_arg(max_hit_tokens)?;
        let q = PromptKeys {
            cache_salt: salt.as_deref(),
            lora_id: lora,
            block_hashes: keys.as_deref(),
            max_hit_tokens: cap,
            loaded_tokens: loaded_arg(loaded_tokens)?,
        };
        let prompt = match &toks {
            Some(t) => PromptLen::Tokens(t),
            None => PromptLen::Count(count),
        };
        let detach = toks.as_ref().is_some_and(|t| t.len() >= DETACH_MIN_TOKENS);
        let status = run(py, detach, || self.inner.can_allocate_with(prompt, new, &q))?;
        objects::alloc_status(py, status)
    }

    /// Whether a swapped-out sequence fits back now: `AllocStatus.OK`, `LATER` or
    /// `NEVER`. Changes nothing.
    fn can_swap_in<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = self::seq_id(seq_id)?;
        let status = run(py, false, || self.inner.can_swap_in(id))?;
        objects::alloc_status(py, status)
    }

    /// Take these GPU blocks out of the prefix cache (their KV is bad, say after a failed
    /// load): a cached unreferenced block becomes free, a block sequences hold stays theirs
    /// but is no longer hit (and is freed, not cached, after its last holder lets go).
    ///
    /// Blocks not in the cache are ignored. Returns how many left the cache. `block_ids`:
    /// a list, tuple, range or 1-D integer array; an id out of range or the null block is an
    /// error naming it, and nothing changes.
    fn evict_blocks(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = self::block_ids(block_ids)?;
        run(py, ids.len() >= DETACH_MIN_BATCH, || {
            self.inner.evict_blocks(&ids)
        })
    }

    /// What `allocate` would take now: `(hit_tokens, new_blocks, revived_blocks)`.
    ///
    /// The prompt's cached prefix in tokens, the blocks it would take from the free pool,
    /// and its hit blocks that are cached but unreferenced (each also takes one block of
    /// the available ones), summed over the groups. `num_tokens_or_token_ids`: a length (no
    /// hit) or the prompt's token ids. Changes nothing.
    #[pyo3(
        signature = (num_tokens_or_token_ids, *, num_new_tokens=None, cache_salt=None,
            lora_id=None, block_hashes=None, max_hit_tokens=None, lookahead=Given::Absent,
            loaded_tokens=None),
        text_signature = "($self, num_tokens_or_token_ids, *, num_new_tokens=None, \
            cache_salt=None, lora_id=None, block_hashes=None, max_hit_tokens=None, lookahead=0, \
            loaded_tokens=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn allocation_cost(
        &self,
        py: Python<'_>,
        num_tokens_or_token_ids: &Bound<'_, PyAny>,
        num_new_tokens: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_hit_tokens: Option<&Bound<'_, PyAny>>,
        lookahead: Given<'_>,
        loaded_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, usize, usize)> {
        let arg = num_tokens_or_token_ids;
        // A count (an int), or the prompt itself (token ids), as for `can_allocate`.
        let (count, toks) = if is_count(arg) {
            (Some(token_count(arg)? as u64), Vec::new())
        } else {
            (None, tokens(arg)?)
        };
        let new = new_tokens_arg(num_new_tokens)?.map(|k| k as u64);
        let salt = salt_arg(cache_salt)?;
        let lora = lora_arg(lora_id)?;
        let keys = keys_arg(block_hashes)?;
        let max_hit = max_hit_arg(max_hit_tokens)?;
        let lookahead = lookahead_arg(&lookahead)?;
        let loaded = loaded_arg(loaded_tokens)?;
        if let Some(n) = count {
            if keys.is_some() {
                return Err(invalid(
                    py,
                    "block_hashes= needs the prompt's token ids (a length has no hit)",
                ));
            }
            let cost = self.inner.allocation_cost_count(n, new, lookahead).py(py)?;
            // A length has no hit, but its loaded tokens are checked as a prompt's are.
            let k = new.unwrap_or(n).min(n);
            if loaded as u64 > k {
                return Err(invalid(
                    py,
                    format!(
                        "loaded_tokens {loaded} exceeds the {k} tokens scheduled past the hit \
                         (loaded tokens are among them)"
                    ),
                ));
            }
            return Ok(cost);
        }
        let q = PromptKeys {
            cache_salt: salt.as_deref(),
            lora_id: lora,
            block_hashes: keys.as_deref(),
            max_hit_tokens: max_hit,
            loaded_tokens: loaded,
        };
        run(py, toks.len() >= DETACH_MIN_TOKENS, || {
            self.inner.allocation_cost(&toks, new, &q, lookahead)
        })
    }

    /// The hit `allocate` would pin now: `(hit_tokens, blocks)`, `blocks[g]` the first
    /// table entries of group `g` (the null block 0 where the group no longer needs one;
    /// one list without `groups=`). `loaded_tokens`: as `allocate`'s. Changes nothing.
    #[pyo3(
        signature = (token_ids, *, cache_salt=None, lora_id=None, block_hashes=None,
            max_hit_tokens=None, loaded_tokens=None),
        text_signature = "($self, token_ids, *, cache_salt=None, lora_id=None, \
            block_hashes=None, max_hit_tokens=None, loaded_tokens=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn lookup_blocks(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_id: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_hit_tokens: Option<&Bound<'_, PyAny>>,
        loaded_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, Vec<Vec<u32>>)> {
        let toks = tokens(token_ids)?;
        let salt = salt_arg(cache_salt)?;
        let keys = keys_arg(block_hashes)?;
        let q = PromptKeys {
            cache_salt: salt.as_deref(),
            lora_id: lora_arg(lora_id)?,
            block_hashes: keys.as_deref(),
            max_hit_tokens: max_hit_arg(max_hit_tokens)?,
            loaded_tokens: loaded_arg(loaded_tokens)?,
        };
        run(py, toks.len() >= DETACH_MIN_TOKENS, || {
            self.inner.lookup_blocks(&toks, &q)
        })
    }

    /// Each group's own hit, looked up independently (vLLM's per-group hits, which diverge
    /// under eviction): `[(hit_tokens, blocks), ...]`, one per group (one without
    /// `groups=`), `blocks` that group's first table entries for its hit (the null block 0
    /// where it needs none). Each hit is at most the one `allocate` may take (one token is
    /// computed; `max_hit_tokens`). Changes nothing.
    #[pyo3(
        signature = (token_ids, *, block_hashes=None, max_hit_tokens=None),
        text_signature = "($self, token_ids, *, block_hashes=None, max_hit_tokens=None)"
    )]
    fn lookup_blocks_per_group(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        max_hit_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(usize, Vec<u32>)>> {
        let toks = tokens(token_ids)?;
        let keys = keys_arg(block_hashes)?;
        let q = PromptKeys {
            block_hashes: keys.as_deref(),
            max_hit_tokens: max_hit_arg(max_hit_tokens)?,
            ..PromptKeys::default()
        };
        run(py, toks.len() >= DETACH_MIN_TOKENS, || {
            self.inner.lookup_blocks_per_group(&toks, &q)
        })
    }

    /// One new token per sequence (a decode step for the whole batch), plus
    /// `lookahead` draft slots each.
    ///
    /// Returns the copy-on-write pairs as an int32 `(k, 2)` array, or None if the batch does not
    /// fit (nothing changed). Ids must be distinct, resident and fully scheduled. `evicted`:
    /// as `allocate`'s.
    #[pyo3(
        signature = (seq_ids, token_ids, *, lookahead=Given::Absent, evicted=None),
        text_signature = "($self, seq_ids, token_ids, *, lookahead=0, evicted=None)"
    )]
    fn append_batch<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        token_ids: &Bound<'py, PyAny>,
        lookahead: Given<'py>,
        evicted: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyArray2<i32>>>> {
        let evicted = evicted_arg(evicted, self.records())?;
        let ids = self::seq_ids(seq_ids)?;
        let toks = batch_tokens(token_ids)?;
        let lookahead = lookahead_arg(&lookahead)?;
        // Before anything changes: its result is an array.
        numpy_api(py, "for append_batch's copy pairs (an array)")?;
        let detach = ids.len() >= DETACH_MIN_BATCH;
        let pairs = run_evicting(py, detach, evicted.as_ref(), || {
            self.inner.append_batch_lookahead(&ids, &toks, lookahead)
        })?;
        pairs.map(|p| pairs_array(py, p)).transpose()
    }

    /// A new `RunningBatch` over this manager's sequences, holding `seq_ids` (default none).
    #[pyo3(signature = (seq_ids=None))]
    fn running_batch(
        slf: &Bound<'_, Self>,
        seq_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<crate::running::PyRunningBatch> {
        let py = slf.py();
        let mgr = &slf.get().inner;
        let ids = seq_ids.map(self::seq_ids).transpose()?;
        let batch = mgr.running_batch();
        if let Some(ids) = ids {
            run(py, ids.len() >= DETACH_MIN_BATCH, || {
                mgr.batch_add(&batch, &ids)
            })?;
        }
        Ok(crate::running::PyRunningBatch::new(
            slf.clone().unbind(),
            batch,
        ))
    }

    /// `free` each sequence, in the given order; all or nothing.
    fn free_batch(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        run(py, ids.len() >= DETACH_MIN_BATCH, || {
            self.inner.free_batch(&ids)
        })
    }

    /// The block tables of `group` as one int32 `(batch, longest table)` array,
    /// padded with `pad`.
    #[pyo3(
        signature = (seq_ids, pad=Given::Absent, *, group=Given::Absent),
        text_signature = "($self, seq_ids, pad=-1, *, group=0)"
    )]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        pad: Given<'py>,
        group: Given<'py>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ids = self::seq_ids(seq_ids)?;
        let pad = opt_int_arg(&pad, -1, "pad", i64::from(i32::MIN), i64::from(i32::MAX))? as i32;
        let group = group_arg(&group)?;
        numpy_api(py, "for block_tables (an array)")?;
        let detach = ids.len() >= DETACH_MIN_BATCH;
        let (flat, width) = run(py, detach, || self.inner.block_tables_of(&ids, pad, group))?;
        let array = Array2::from_shape_vec((ids.len(), width), flat)
            .map_err(|e| invalid(py, format!("internal shape error: {e}")))?;
        Ok(array.into_pyarray(py))
    }

    /// int64 cache slots (`block * block_size + offset`) of each sequence's last
    /// `num_new_tokens` scheduled tokens (an int, or one per sequence), then of its
    /// `lookahead` draft positions (an int, or one per sequence); concatenated in batch order.
    #[pyo3(
        signature = (seq_ids, num_new_tokens, *, lookahead=Given::Absent, group=Given::Absent),
        text_signature = "($self, seq_ids, num_new_tokens, *, lookahead=0, group=0)"
    )]
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        lookahead: Given<'py>,
        group: Given<'py>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ids = self::seq_ids(seq_ids)?;
        let n = counts(num_new_tokens, ids.len(), "num_new_tokens")?;
        let lookahead = lookaheads(&lookahead)?;
        let group = group_arg(&group)?;
        numpy_api(py, "for slot_mapping (an array)")?;
        let detach = ids.len() >= DETACH_MIN_BATCH;
        let slots = run(py, detach, || {
            self.inner
                .slot_mapping_of(&ids, &n, lookahead.as_core(), group)
        })?;
        Ok(slots.into_pyarray(py))
    }

    /// `(kv_indptr, kv_indices, kv_last_page_len)`, int32, over the scheduled tokens of
    /// each sequence plus its `lookahead` draft slots (an int, or one per sequence): the
    /// page table FlashInfer's paged wrappers take.
    #[allow(clippy::type_complexity)]
    #[pyo3(
        signature = (seq_ids, *, lookahead=Given::Absent, group=Given::Absent),
        text_signature = "($self, seq_ids, *, lookahead=0, group=0)"
    )]
    fn flashinfer_page_table<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        lookahead: Given<'py>,
        group: Given<'py>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
    )> {
        let ids = self::seq_ids(seq_ids)?;
        let lookahead = lookaheads(&lookahead)?;
        let group = group_arg(&group)?;
        numpy_api(py, "for flashinfer_page_table (arrays)")?;
        let detach = ids.len() >= DETACH_MIN_BATCH;
        let (indptr, indices, last) = run(py, detach, || {
            self.inner
                .flashinfer_page_table_of(&ids, lookahead.as_core(), group)
        })?;
        Ok((
            indptr.into_pyarray(py),
            indices.into_pyarray(py),
            last.into_pyarray(py),
        ))
    }

    /// The sequence's GPU block ids in `group`, in token order (0 is the null block
    /// with groups); `start`/`stop`: entries `start..stop` only (clamped as a slice is), so
    /// that a caller after a chunk's new entries does not pay an int for every block.
    #[pyo3(
        signature = (seq_id, start = None, stop = None, *, group=Given::Absent),
        text_signature = "($self, seq_id, start=None, stop=None, *, group=0)"
    )]
    fn block_table(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        start: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        group: Given<'_>,
    ) -> PyResult<Vec<u32>> {
        let id = self::seq_id(seq_id)?;
        let range = slice_bounds(start, stop)?;
        let group = group_arg(&group)?;
        let mut table = run(py, false, || self.inner.block_table_of(id, group))?;
        Ok(clamp_slice(&mut table, range))
    }

    /// Tokens the sequence holds: its prompt plus appended tokens.
    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.num_tokens(id))
    }

    /// Tokens scheduled for compute so far (less than `num_tokens` while
    /// a chunked prefill is under way).
    fn num_scheduled_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.num_scheduled_tokens(id))
    }

    /// A 64-bit digest of the sequence's block tables: equal tables, equal
    /// digests.
    fn table_digest(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<u64> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.table_digest(id))
    }

    /// The chain digests of the sequence's full blocks (docs/hashing.md); `start`/`stop`:
    /// only blocks `start..stop` of them (clamped as a slice is), so that a caller after a
    /// few does not pay a bytes object for every block of a long sequence.
    #[pyo3(signature = (seq_id, start = None, stop = None))]
    fn block_hashes<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
        start: Option<&Bound<'py, PyAny>>,
        stop: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let id = self::seq_id(seq_id)?;
        let range = slice_bounds(start, stop)?;
        let mut digests = run(py, false, || self.inner.block_hashes(id))?;
        Ok(clamp_slice(&mut digests, range)
            .iter()
            .map(|d| PyBytes::new(py, d.as_bytes()))
            .collect())
    }

    /// The number of keys (block digests) the sequence has: its caller's keys, or for a
    /// self-hashed sequence its full blocks' digests (0 with prefix caching off).
    fn num_block_hashes(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.num_block_hashes(id))
    }

    /// Whether the sequence is swapped out to CPU blocks.
    fn is_swapped(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = self::seq_id(seq_id)?;
        run(py, false, || self.inner.is_swapped(id))
    }

    fn __contains__(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Some(id) = maybe_seq_id(seq_id) else {
            return Ok(false);
        };
        Ok(self.inner.contains(id))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.inner.num_sequences())
    }

    /// GPU blocks in the pool.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.inner.config().num_blocks as usize
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    /// CPU swap blocks.
    #[getter]
    fn num_cpu_blocks(&self) -> usize {
        self.inner.config().num_cpu_blocks as usize
    }

    /// KV-cache groups (1 without `groups=`).
    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.kinds().len()
    }

    /// GPU blocks held by nobody and not cached.
    #[getter]
    fn num_free_blocks(&self) -> PyResult<usize> {
        Ok(self.inner.num_free_blocks())
    }

    /// GPU blocks held by nobody that still serve prefix hits (evicted
    /// least recently released first when a free block is needed).
    #[getter]
    fn num_cached_blocks(&self) -> PyResult<usize> {
        Ok(self.inner.num_cached_blocks())
    }

    /// GPU blocks that can be handed out now: free plus cached.
    #[getter]
    fn num_available_blocks(&self) -> PyResult<usize> {
        Ok(self.inner.num_available_blocks())
    }

    /// CPU swap blocks not in use.
    #[getter]
    fn num_free_cpu_blocks(&self) -> PyResult<usize> {
        Ok(self.inner.num_free_cpu_blocks())
    }

    /// A `Stats` snapshot: usage, prefix hits (overall and over the last 1,000
    /// allocations), evictions, copies, swaps, registrations, per-group figures.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        {
            objects::stats(py, &self.inner.stats(), &self.inner.group_stats())
        }
    }

    /// Forget every cached block (the hit-rate counters restart).
    ///
    /// Returns False, changing nothing, while any resident sequence holds a block.
    fn reset_prefix_cache(&self, py: Python<'_>) -> PyResult<bool> {
        // Waits for calls in flight: always without the GIL.
        run(py, true, || self.inner.reset_prefix_cache())
    }

    /// Whether calls report the cached blocks they evict (`evicted=`): the
    /// `record_evictions` the manager was built with.
    #[getter]
    fn record_evictions(&self) -> bool {
        self.records()
    }

    /// Whether the manager groups requests by cache salt (`tenants=`).
    #[getter]
    fn tenants(&self) -> bool {
        self.inner.config().tenants
    }

    /// Set the quota of the tenant of `cache_salt` (None: requests without a salt):
    /// `max_cached`, the most CACHED blocks it keeps (None: no cap; a lower cap evicts its
    /// own blocks at once), and `reserved`, CACHED blocks other tenants' evictions leave
    /// alone while anyone else has blocks above their own reserve. The defaults (no cap,
    /// no reserve) remove the tenant's quota, and its own policy instance with it. Needs
    /// `tenants=True`. Runs without the GIL (a first quota builds the tenant's instance).
    #[pyo3(
        signature = (cache_salt, *, max_cached=None, reserved=Given::Absent),
        text_signature = "($self, cache_salt, *, max_cached=None, reserved=0)"
    )]
    fn set_tenant_quota(
        &self,
        py: Python<'_>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        max_cached: Option<&Bound<'_, PyAny>>,
        reserved: Given<'_>,
    ) -> PyResult<()> {
        let salt = salt_arg(cache_salt)?;
        let max = i64::from(i32::MAX);
        let quota = Quota {
            max_cached: max_cached
                .map(|c| int_arg(c, "max_cached", 0, max).map(|c| c as usize))
                .transpose()?,
            reserved: opt_int_arg(&reserved, 0, "reserved", 0, max)? as usize,
        };
        run(py, true, || {
            self.inner.set_tenant_quota(salt.as_deref(), quota)
        })
    }

    /// Per tenant present, unsalted first then in order of entry: `(cache_salt, held_blocks,
    /// cached_blocks, prefix_queries, prefix_hits, max_cached, reserved)`
    /// (`BlockManager.tenant_stats` makes `TenantStats` of them).
    fn _tenant_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        // Without the GIL: it looks at every live sequence and every tenant.
        let stats = py.detach(|| self.inner.tenant_stats()).py(py)?;
        stats
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                // Hand the GIL over now and then: 200,000 tenants take a while to convert.
                if i > 0 && i % 256 == 0 {
                    py.detach(|| ());
                }
                let salt = t.salt.map(|s| PyBytes::new(py, &s));
                (
                    salt,
                    t.held_blocks,
                    t.cached_blocks,
                    t.prefix_queries,
                    t.prefix_hits,
                    t.quota.max_cached,
                    t.quota.reserved,
                )
                    .into_pyobject(py)
                    .map(|o| o.into_any())
            })
            .collect()
    }

    /// The eviction policy the manager was built with (`eviction=`).
    #[getter]
    fn eviction(&self) -> &'static str {
        self.inner.config().eviction.name()
    }

    /// The chain hash the manager was built with (`hash_algo=`): what a `TieredCache` must
    /// key its tiers by.
    #[getter]
    fn hash_algo(&self) -> &'static str {
        match self.inner.config().hash_algo {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Xxh3_128 => "xxh3_128",
            HashAlgo::Xxh3Trunc8 => "xxh3_128_trunc8_testing",
        }
    }

    /// The seed of the chain hash (`hash_seed=`).
    #[getter]
    fn hash_seed(&self) -> u64 {
        self.inner.config().hash_seed
    }

    /// Whether full blocks are registered in the prefix cache (`enable_prefix_caching=`).
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }

    /// The `groups=` the manager was built with, as `KVCacheGroup`s of their kinds and sizes
    /// (`num_layers` is a pool's matter and not kept), or None without `groups=`.
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if !self.inner.is_grouped() {
            return Ok(None);
        }
        let cls = py.import("pagedkv.groups")?.getattr("KVCacheGroup")?;
        let groups = self
            .inner
            .kinds()
            .iter()
            .map(|k| {
                let kw = PyDict::new(py);
                match *k {
                    GroupKind::SlidingWindow { window } => kw.set_item("window", window)?,
                    GroupKind::ChunkedLocal { chunk } => kw.set_item("chunk", chunk)?,
                    GroupKind::Full | GroupKind::State => {}
                }
                cls.call((k.name(),), Some(&kw))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Some(PyTuple::new(py, groups)?.into_any()))
    }

    /// The KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) since the
    /// last call, in order (needs `enable_kv_events=True`).
    /// Raises `KVEventsOverflowError`, changing nothing, once a bounded queue overflowed
    /// (`set_kv_event_capacity`): take `kv_event_snapshot()` then.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let events = self.inner.drain_events().py(py)?;
        self.handed_on(objects::events(py, &events), events.len())
    }

    /// Every block the events so far describe, one `BlockStored` each (parents first),
    /// taken between two events: the queue restarts empty and an overflow is forgotten, so
    /// the next `drain_events()` gives exactly the changes after it.
    fn kv_event_snapshot<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let snapshot = py.detach(|| self.inner.kv_event_snapshot()).py(py)?;
        self.handed_on(
            objects::events_from(py, snapshot.iter(), snapshot.len()),
            snapshot.len(),
        )
    }

    /// Bound the event queue at `capacity` events (None: unbounded, the default). A call
    /// that finds it full never waits: the queue and every event until the next snapshot
    /// are dropped and counted, and `drain_events()` raises `KVEventsOverflowError`.
    #[pyo3(signature = (capacity))]
    fn set_kv_event_capacity(&self, py: Python<'_>, capacity: &Bound<'_, PyAny>) -> PyResult<()> {
        let capacity = if capacity.is_none() {
            None
        } else {
            Some(int_arg(capacity, "capacity", 1, i64::MAX)? as usize)
        };
        self.inner.set_kv_event_capacity(capacity).py(py)
    }

    /// The event queue's tallies (`pagedkv.events.KVEventQueueStats`).
    fn kv_event_queue_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = self.inner.kv_event_queue_stats().py(py)?;
        objects::event_queue_stats(py, &s)
    }

    /// Audit the manager's internal invariants; raises `InvariantError` with the
    /// first violation. Exact only when no other call is in flight.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check_invariants()).py(py)
    }

    fn __repr__(&self) -> PyResult<String> {
        let c = self.inner.config().clone();
        let groups = if self.inner.is_grouped() {
            let kinds: Vec<&str> = self.inner.kinds().iter().map(|k| k.name()).collect();
            format!(", groups=[{}]", kinds.join(", "))
        } else {
            String::new()
        };
        Ok(format!(
            "BlockManager(num_blocks={}, block_size={}, num_cpu_blocks={}{groups}, sequences={}, free={}, cached={})",
            c.num_blocks,
            c.block_size,
            c.num_cpu_blocks,
            self.__len__()?,
            self.num_free_blocks()?,
            self.num_cached_blocks()?
        ))
    }
}

/// `start`/`stop` of a per-sequence listing: ints from 0 (bad ones raise, naming which);
/// None: from the first, to the last.
fn slice_bounds(
    start: Option<&Bound<'_, PyAny>>,
    stop: Option<&Bound<'_, PyAny>>,
) -> PyResult<(usize, Option<usize>)> {
    let start = match start {
        Some(s) => int_arg(s, "start", 0, i64::MAX)? as usize,
        None => 0,
    };
    let stop = match stop {
        Some(s) => Some(int_arg(s, "stop", 0, i64::MAX)? as usize),
        None => None,
    };
    Ok((start, stop))
}

/// `items[start..stop]`, clamped to its length as a Python slice is (empty when `start`
/// is past `stop`), taken out of `items` without copying the rest.
fn clamp_slice<T>(items: &mut Vec<T>, (start, stop): (usize, Option<usize>)) -> Vec<T> {
    let stop = stop.unwrap_or(usize::MAX).min(items.len());
    items.truncate(stop);
    items.split_off(start.min(stop))
}
