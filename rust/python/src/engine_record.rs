//! `pagedkv._core.EngineRecord`: an engine adapter's record of one request (the core's
//! `EngineRecord`) and its decode step, read straight from the engine's request object so
//! that a step costs one call. Argument and result conversion only; the plan and the step
//! are the core's (`engine_record.rs`).

use crate::convert::{batch_tokens, id_arg, int_arg, keys_arg};
use crate::deferred_decode::PyDeferredDecodes;
use crate::errors::IntoPy;
use crate::manager::PyBlockManager;
use pagedkv_core::{nonblocking, DecodeCall, EngineRecord, Error, SeqHandle};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PySlice, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What a request's record holds besides the core's counters.
pub(crate) struct State {
    pub(crate) rec: EngineRecord,
    /// The sequence's cell, resolved on the first step.
    pub(crate) handle: Option<SeqHandle>,
    /// The companion sequence of a cross-attention group, if any.
    cross: Option<u64>,
    /// The one-token steps planned ahead (`DeferredDecodes`); ended by every other change
    /// of the record (`end_run`).
    pub(crate) run: Option<Run>,
    /// In `DeferredDecodes`'s list of records that may hold answered steps (so that it
    /// lists each record once); cleared when that list is applied and emptied.
    pub(crate) listed: bool,
}

/// A run of one-token decode steps planned ahead (`deferred_decode.rs`): each writes the
/// request's next known token into a slot the sequence already holds, so the engine's call
/// is answered at once and the token appended later. Steps `rec.known .. taken_to` are
/// answered and not applied (the sequence knows `rec.known` tokens); the step at `taken_to`
/// is the one planned next, while `taken_to < end`.
pub(crate) struct Run {
    /// `DeferredDecodes`'s epoch when planned: a settle moves the epoch on, so a run planned
    /// before it is never planned on (what it proved may no longer hold).
    pub(crate) epoch: u64,
    /// The position of the next step to answer; the steps before it from `rec.known` on are
    /// answered and wait to be applied.
    pub(crate) taken_to: usize,
    /// Steps below this position write in place (`BlockManager::in_place_end`).
    pub(crate) end: usize,
    /// A run of the one step that fills its block and hands over its key: the engine's key
    /// and the record's keys after it.
    pub(crate) key: Option<(Vec<u8>, usize)>,
}

impl State {
    /// Steps answered and not applied yet.
    pub(crate) fn pending(&self) -> usize {
        self.run
            .as_ref()
            .map_or(0, |r| r.taken_to.saturating_sub(self.rec.known))
    }

    /// End the run before the record changes otherwise. An error, changing nothing, while
    /// it holds steps answered and not applied (the adapter applies them first): dropping
    /// them would leave the sequence behind the engine.
    pub(crate) fn end_run(&mut self) -> PyResult<()> {
        if self.pending() > 0 {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "pagedkv.vllm: sequence {} changed with {} answered decode steps not applied",
                self.rec.seq,
                self.pending()
            )));
        }
        self.run = None;
        Ok(())
    }
}

/// One request of an engine adapter (pagedkv.vllm): its sequence, how far the sequence
/// has come (`have` known tokens, `scheduled` of them scheduled, `nkeys` keys handed over,
/// `table_len` table entries given out, `held` registration), and `decode`, the per-step
/// call. The fields are read and set by the adapter's general paths; `decode` reads and
/// updates them under the record's lock, together with the sequence.
#[pyclass(frozen, module = "pagedkv._core", name = "EngineRecord")]
pub struct PyEngineRecord {
    pub(crate) mgr: Py<PyBlockManager>,
    /// The engine's request object (the adapter reads it back for block views).
    pub(crate) request: Py<PyAny>,
    /// What `decode` returns when a step added no table entry and nothing else is due.
    unchanged: Py<PyAny>,
    /// vLLM's token buffer of the request (`_all_token_ids`, one object for the request's
    /// life: a list up to vLLM 0.33, an `array('i')` subclass from 0.34), read by the
    /// deferred steps without a lookup on the request; None for a request without one.
    pub(crate) tokens: Option<Py<PyAny>>,
    /// Set when `decode` found `tokens` replaced (then nothing is planned for the record).
    pub(crate) tokens_replaced: AtomicBool,
    /// vLLM ids are the core's plus this (vLLM reserves block 0).
    offset: u32,
    pub(crate) max_len: usize,
    /// Engine hash blocks per block: the key of block `i` is hash `(i + 1) * ratio - 1`.
    pub(crate) hash_ratio: usize,
    state: Mutex<State>,
}

pub(crate) fn count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    Ok(int_arg(obj, what, 0, i64::MAX)? as usize)
}

/// One token id, in `[0, 2**32)`.
pub(crate) fn token(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    Ok(int_arg(obj, "token id", 0, i64::from(u32::MAX))? as u32)
}

pub(crate) fn attr_count(
    obj: &Bound<'_, PyAny>,
    name: &Bound<'_, pyo3::types::PyString>,
) -> PyResult<usize> {
    let v = obj.getattr(name)?;
    // The message's name is formatted only when there is a message to write.
    count(&v, "request attribute").or_else(|_| count(&v, &format!("request.{name}")))
}

/// Token `i` of a request's token buffer (`PyEngineRecord::tokens`): a list's item, or an
/// int32 buffer's element read in place (vLLM 0.34's `TokenBuffer` indexes in Python).
pub(crate) fn token_at(tokens: &Bound<'_, PyAny>, i: usize) -> PyResult<u32> {
    if let Ok(list) = tokens.cast::<PyList>() {
        return token(&list.get_item(i)?);
    }
    let buf = PyBuffer::<i32>::get(tokens)?;
    let value = buf
        .as_slice(tokens.py())
        .and_then(|s| s.get(i).map(|c| c.get()))
        .ok_or_else(|| PyIndexError::new_err(format!("token {i} of the request's buffer")))?;
    u32::try_from(value).map_err(|_| PyValueError::new_err(format!("token id {value}")))
}

/// The request's token list: vLLM's list itself (its `all_token_ids` is a read-only
/// wrapper whose slicing runs Python); the wrapper where the list is not there.
pub(crate) fn token_list<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = request.py();
    match request.getattr(intern!(py, "_all_token_ids")) {
        Ok(l) => Ok(l),
        Err(_) => request.getattr(intern!(py, "all_token_ids")),
    }
}

impl PyEngineRecord {
    /// The record's state, locked. Never waits for the lock while holding the GIL: a holder
    /// may be waiting for the GIL itself (a core call that detached).
    pub(crate) fn state(&self, py: Python<'_>) -> MutexGuard<'_, State> {
        loop {
            match self.state.try_lock() {
                Ok(g) => return g,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    py.detach(|| drop(self.state.lock()));
                }
            }
        }
    }
}

#[pymethods]
impl PyEngineRecord {
    #[new]
    #[pyo3(signature = (manager, request, seq_id, have, scheduled, nkeys, table_len, held, *, unchanged, offset, max_len, hash_ratio))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        manager: Py<PyBlockManager>,
        request: Py<PyAny>,
        seq_id: &Bound<'_, PyAny>,
        have: &Bound<'_, PyAny>,
        scheduled: &Bound<'_, PyAny>,
        nkeys: &Bound<'_, PyAny>,
        table_len: &Bound<'_, PyAny>,
        held: bool,
        unchanged: Py<PyAny>,
        offset: &Bound<'_, PyAny>,
        max_len: &Bound<'_, PyAny>,
        hash_ratio: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let rec = EngineRecord {
            seq: id_arg(seq_id, "seq_id")?,
            known: count(have, "have")?,
            scheduled: count(scheduled, "scheduled")?,
            keys: count(nkeys, "nkeys")?,
            table_len: count(table_len, "table_len")?,
            held,
        };
        let py = seq_id.py();
        let tokens = request
            .bind(py)
            .getattr(intern!(py, "_all_token_ids"))
            .ok()
            .filter(|t| t.is_instance_of::<PyList>() || PyBuffer::<i32>::get(t).is_ok())
            .map(Bound::unbind);
        Ok(Self {
            mgr: manager,
            request,
            unchanged,
            tokens,
            tokens_replaced: AtomicBool::new(false),
            offset: int_arg(offset, "offset", 0, 1)? as u32,
            max_len: count(max_len, "max_len")?,
            hash_ratio: int_arg(hash_ratio, "hash_ratio", 1, i64::from(u32::MAX))? as usize,
            state: Mutex::new(State {
                rec,
                handle: None,
                cross: None,
                run: None,
                listed: false,
            }),
        })
    }

    /// `allocate_slots` of a decode step: the request's new known tokens appended with the
    /// keys of its newly full blocks and `num_lookahead_tokens` slots past them, the
    /// skipping groups' entries released first. Returns False when the call is not a
    /// decode step for this record (the caller's general path then runs), None when the
    /// blocks do not fit (nothing changed but the release), `unchanged` when no table
    /// entry was added and nothing else is due, else `(first_entry, ids, pairs, keys_from)`:
    /// the new entries' vLLM ids per core group (None if none), the copy-on-write pairs
    /// (vLLM ids) and the first key handed over (None if none). `deferred`: the adapter's
    /// deferred steps (`DeferredDecodes`): the keyed ones applied first, and this record's
    /// own, when it has a run or when this step may hand over a key.
    #[pyo3(signature = (request, num_new_tokens, num_lookahead_tokens, deferred = None))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
        num_lookahead_tokens: &Bound<'py, PyAny>,
        deferred: Option<&Bound<'py, PyDeferredDecodes>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mgr = &self.mgr.get().inner;
        let computed = attr_count(request, intern!(py, "num_computed_tokens"))?;
        let new_tokens = count(num_new_tokens, "num_new_tokens")?;
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        let all = token_list(request)?;
        if let Some(t) = &self.tokens {
            if !all.is(t) {
                // Relaxed: a flag this thread and later calls read under the GIL.
                self.tokens_replaced.store(true, Ordering::Relaxed);
            }
        }
        let num_tokens = all.len()?;
        let caching = mgr.config().enable_prefix_caching;
        let releases = mgr.releases_entries();
        let in_flight = if releases {
            attr_count(request, intern!(py, "num_in_flight_tokens"))?
        } else {
            0
        };
        let call = DecodeCall {
            computed,
            new_tokens,
            lookahead,
            num_tokens,
            // Read below only when the plan wants keys (once a block).
            num_keys: usize::MAX,
            max_len: self.max_len,
            in_flight,
        };
        let mut st = self.state(py);
        if let Some(d) = deferred {
            // The deferred steps write in place: they touch neither the pool nor another
            // sequence, so this step waits for them only when one of them may be its own
            // (the record holds a plan) or when it may hand over a key (the steps answered
            // before it register their blocks first, in call order); the rest apply later in
            // one batch. Over-counting the keys only applies them sooner.
            let keyed = caching && (computed + new_tokens) / mgr.block_size() > st.rec.keys;
            if st.run.is_some() || keyed {
                drop(st);
                d.get().apply_for_record(py, Some(self))?;
                st = self.state(py);
            }
        }
        st.end_run()?;
        let Some(mut plan) = st
            .rec
            .plan_decode(&call, mgr.block_size(), caching, releases)
        else {
            return Ok(PyBool::new(py, false).to_owned().into_any());
        };
        let keys = if plan.keys.is_empty() {
            None
        } else {
            let hashes = request.getattr(intern!(py, "block_hashes"))?;
            plan.limit_keys(hashes.len()? / self.hash_ratio);
            let r = self.hash_ratio;
            let picked = PyList::empty(py);
            for i in plan.keys.clone() {
                picked.append(hashes.get_item((i + 1) * r - 1)?)?;
            }
            if plan.keys.is_empty() {
                None
            } else {
                keys_arg(Some(picked.as_any()))?
            }
        };
        let tokens = if plan.tokens.is_empty() {
            Vec::new()
        } else if let Ok(list) = all.cast::<PyList>() {
            let mut out = Vec::with_capacity(plan.tokens.len());
            for i in plan.tokens.clone() {
                out.push(token(&list.get_item(i)?)?);
            }
            out
        } else {
            let slice = PySlice::new(py, plan.tokens.start as isize, plan.tokens.end as isize, 1);
            batch_tokens(&all.get_item(slice)?)?
        };
        let State { rec, handle, .. } = &mut *st;
        let handle = &*match handle.take() {
            Some(h) => handle.insert(h),
            None => handle.insert(mgr.seq_handle(rec.seq).py(py)?),
        };
        let mut step = || mgr.decode_record(rec, handle, &plan, &tokens, keys.as_deref());
        let out = match nonblocking(&mut step) {
            Err(Error::WouldBlock) => py.detach(&mut step),
            other => other,
        }
        .py(py)?;
        drop(st);
        let Some(out) = out else {
            return Ok(py.None().into_bound(py));
        };
        if out.grown.is_none() && out.pairs.is_empty() && out.keys_from.is_none() {
            return Ok(self.unchanged.bind(py).clone());
        }
        let off = self.offset;
        let (first, ids) = match out.grown {
            Some((first, ids)) => {
                let ids: Vec<Vec<u32>> = ids
                    .into_iter()
                    .map(|g| g.into_iter().map(|b| b + off).collect())
                    .collect();
                (Some(first), Some(ids))
            }
            None => (None, None),
        };
        let pairs: Vec<(u32, u32)> = out
            .pairs
            .into_iter()
            .map(|(s, d)| (s + off, d + off))
            .collect();
        Ok(PyTuple::new(
            py,
            [
                first.into_pyobject(py)?.into_any(),
                ids.into_pyobject(py)?.into_any(),
                pairs.into_pyobject(py)?.into_any(),
                out.keys_from.into_pyobject(py)?.into_any(),
            ],
        )?
        .into_any())
    }

    #[getter]
    fn request(&self, py: Python<'_>) -> Py<PyAny> {
        self.request.clone_ref(py)
    }

    #[getter]
    fn sid(&self, py: Python<'_>) -> u64 {
        self.state(py).rec.seq
    }

    #[getter]
    fn cross(&self, py: Python<'_>) -> Option<u64> {
        self.state(py).cross
    }

    #[setter]
    fn set_cross(&self, py: Python<'_>, value: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let v = match value {
            Some(v) if !v.is_none() => Some(id_arg(v, "cross")?),
            _ => None,
        };
        let mut st = self.state(py);
        st.end_run()?;
        st.cross = v;
        Ok(())
    }

    #[getter]
    fn have(&self, py: Python<'_>) -> usize {
        self.state(py).rec.known
    }

    #[setter]
    fn set_have(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = count(value, "have")?;
        let mut st = self.state(py);
        st.end_run()?;
        st.rec.known = v;
        Ok(())
    }

    #[getter]
    fn scheduled(&self, py: Python<'_>) -> usize {
        self.state(py).rec.scheduled
    }

    #[setter]
    fn set_scheduled(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = count(value, "scheduled")?;
        let mut st = self.state(py);
        st.end_run()?;
        st.rec.scheduled = v;
        Ok(())
    }

    #[getter]
    fn nkeys(&self, py: Python<'_>) -> usize {
        self.state(py).rec.keys
    }

    #[setter]
    fn set_nkeys(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = count(value, "nkeys")?;
        let mut st = self.state(py);
        st.end_run()?;
        st.rec.keys = v;
        Ok(())
    }

    #[getter]
    fn table_len(&self, py: Python<'_>) -> usize {
        self.state(py).rec.table_len
    }

    #[setter]
    fn set_table_len(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = count(value, "table_len")?;
        let mut st = self.state(py);
        st.end_run()?;
        st.rec.table_len = v;
        Ok(())
    }

    #[getter]
    fn held(&self, py: Python<'_>) -> bool {
        self.state(py).rec.held
    }

    #[setter]
    fn set_held(&self, py: Python<'_>, value: bool) -> PyResult<()> {
        let mut st = self.state(py);
        st.end_run()?;
        st.rec.held = value;
        Ok(())
    }
}
