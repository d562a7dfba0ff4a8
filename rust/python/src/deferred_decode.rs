//! `pagedkv._core.DeferredDecodes`: the one-token decode steps of an engine adapter answered
//! at once and applied to their sequences later, in a batch (the core's `decode_in_place`
//! says which steps qualify).
//!
//! vLLM's scheduler asks for a running request's slots one request at a time, with its own
//! bookkeeping in between; each call then finds the request's record and sequence cold. Most
//! of those steps write one token into a slot the sequence already holds, so their answer
//! ("no new block") is known before the step: `prime`, once at the start of the step, plans
//! them for every record in one pass; the scheduler's call (the adapter's Python, which pops
//! the request's entry of `planned` and appends its id to `taken`: two dict and list
//! operations, cheaper than any call into Rust) only checks that the call is the planned one;
//! `apply` appends the queued tokens in one pass. Every other call of the adapter applies the
//! queue first (`settle` also forgets the plans), so no call observes a sequence without a
//! step already answered.

use crate::engine_record::{token_at, PyEngineRecord, State};
use crate::errors::IntoPy;
use pagedkv_core::{DecodeCall, Error};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

fn internal(what: &str) -> Error {
    Error::Invariant(format!("pagedkv.vllm deferred decode: {what}"))
}

impl PyEngineRecord {
    /// Plan the record's next step as vLLM's decode of a running request (its next known
    /// token, no lookahead) and keep the plan when the step writes in place; returns the
    /// computed tokens the plan expects (what the engine's call must say), else None. Reads
    /// the record and the request's token list only (and its block hashes once a block,
    /// when the step fills one): the request object itself is cold at the step's start, and
    /// its counters are the record's in a steady decode. `keyed`: a step that fills its
    /// block and hands over the block's key may be planned too (the adapter says no when
    /// it must publish the key's event from the step itself).
    pub(crate) fn prime(&self, py: Python<'_>, keyed: bool) -> PyResult<Option<usize>> {
        // Relaxed: a flag set and read under the GIL.
        let Some(tokens) = self
            .tokens
            .as_ref()
            .filter(|_| !self.tokens_replaced.load(Ordering::Relaxed))
        else {
            return Ok(None);
        };
        let mgr = &self.mgr.get().inner;
        let num_tokens = tokens.bind(py).len()?;
        let bs = mgr.block_size();
        let caching = mgr.config().enable_prefix_caching;
        let mut st = self.state(py);
        st.primed = None;
        // The request's computed tokens are the record's known ones in a steady decode: the
        // plan expects that, and the engine's call is checked against it.
        let computed = st.rec.known;
        let call = DecodeCall {
            computed,
            new_tokens: 1,
            lookahead: 0,
            num_tokens,
            num_keys: usize::MAX,
            max_len: self.max_len,
            in_flight: 0,
        };
        let Some(mut plan) = st
            .rec
            .plan_decode(&call, bs, caching, mgr.releases_entries())
        else {
            return Ok(None);
        };
        let mut key = None;
        if !plan.keys.is_empty() {
            if !keyed {
                return Ok(None);
            }
            let hashes = self.request.bind(py).getattr(intern!(py, "block_hashes"))?;
            plan.limit_keys(hashes.len()? / self.hash_ratio);
            if plan.keys.len() == 1 {
                let item = hashes.get_item((plan.keys.start + 1) * self.hash_ratio - 1)?;
                // Not bytes: the general path's call says what is wrong.
                let Ok(bytes) = item.cast::<PyBytes>() else {
                    return Ok(None);
                };
                key = Some(bytes.as_bytes().to_vec());
            }
        }
        if !plan.is_one_token_keyed(st.rec.table_len, bs) {
            return Ok(None);
        }
        let State {
            rec,
            handle,
            primed,
            primed_key,
            ..
        } = &mut *st;
        if handle.is_none() {
            // A record whose sequence is gone is not primed: its call takes the general
            // path, which says what is wrong.
            match mgr.seq_handle(rec.seq) {
                Ok(h) => *handle = Some(h),
                Err(_) => return Ok(None),
            }
        }
        let Some(h) = handle.as_ref() else {
            return Ok(None);
        };
        if mgr.decode_in_place(rec, h, &plan).unwrap_or(false) {
            *primed = Some(plan);
            *primed_key = key;
            return Ok(Some(computed));
        }
        Ok(None)
    }
}

/// One adapter's deferred one-token steps. The dictionary and the list are Python objects,
/// changed only with the GIL held; `busy` makes an `apply` wait for one in progress (which
/// may release the GIL while it waits for a record), so that its caller then finds every
/// step answered before its call applied.
#[pyclass(frozen, module = "pagedkv._core", name = "DeferredDecodes")]
pub struct PyDeferredDecodes {
    /// request id -> the adapter's record (`EngineRecord`): the adapter's own dict.
    records: Py<PyDict>,
    /// request id -> the computed tokens its planned step expects; an entry exists only
    /// while its record holds the plan (a record's other changes come through the adapter,
    /// which settles first, emptying this).
    primed: Py<PyDict>,
    /// request ids whose planned step was taken and not applied yet, in call order.
    queued: Py<PyList>,
    /// Held while queued steps are applied.
    busy: Mutex<()>,
    /// Queued steps found without their plan or record when applied (only a race of two
    /// threads on one request does that; the tests assert it stays 0).
    skipped: AtomicUsize,
    /// Steps applied since the start (a statistic for tests and benchmarks).
    applied: AtomicUsize,
}

impl PyDeferredDecodes {
    fn busy(&self, py: Python<'_>) -> MutexGuard<'_, ()> {
        loop {
            match self.busy.try_lock() {
                Ok(g) => return g,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => py.detach(|| drop(self.busy.lock())),
            }
        }
    }

    /// `apply`: every step taken so far applied (waiting for an apply in progress).
    pub(crate) fn apply_all(&self, py: Python<'_>) -> PyResult<()> {
        let _busy = self.busy(py);
        self.apply_queued(py)
    }

    /// Apply every queued step (the caller holds `busy`): each record's plan taken under
    /// its lock, held until the step is applied, and the tokens appended in one core call.
    fn apply_queued(&self, py: Python<'_>) -> PyResult<()> {
        let queued = self.queued.bind(py);
        let n = queued.len();
        if n == 0 {
            return Ok(());
        }
        // Nothing changes until the core has appended the tokens: an error before that
        // (a token that cannot be read, a refused append) leaves the queue and the plans as
        // they were, so no answered step is lost and none is applied twice.
        let ids: Vec<Bound<'_, PyAny>> = queued.iter().take(n).collect();
        let records = self.records.bind(py);
        let mut recs = Vec::with_capacity(n);
        // Steps found without their plan or record: their request was freed, or changed by
        // a call that caught its tokens up itself, between the answer and now (a race of two
        // threads on one request; the answer, "no new block", was right when given).
        let mut skipped = 0;
        for rid in &ids {
            match records.get_item(rid)? {
                Some(rec) => recs.push(rec.cast_into::<PyEngineRecord>()?),
                None => skipped += 1,
            }
        }
        let (mut states, mut plans, mut tokens, mut keys) = (
            Vec::with_capacity(recs.len()),
            Vec::with_capacity(recs.len()),
            Vec::with_capacity(recs.len()),
            Vec::with_capacity(recs.len()),
        );
        for rec in &recs {
            let rec = rec.get();
            let st = rec.state(py);
            let Some(plan) = st.primed.clone() else {
                skipped += 1;
                continue;
            };
            let Some(buf) = rec.tokens.as_ref() else {
                return Err(internal("a plan without the request's tokens")).py(py);
            };
            tokens.push(token_at(buf.bind(py), plan.tokens.start)?);
            keys.push(if plan.keys.is_empty() {
                None
            } else {
                Some(
                    st.primed_key
                        .clone()
                        .ok_or_else(|| internal("a keyed plan without its key"))
                        .py(py)?,
                )
            });
            plans.push(plan);
            states.push(st);
        }
        if let Some(first) = recs.first() {
            let mgr = &first.get().mgr.get().inner;
            let handles = states
                .iter()
                .map(|st| {
                    st.handle
                        .as_ref()
                        .ok_or_else(|| internal("a plan without a sequence"))
                })
                .collect::<Result<Vec<_>, _>>()
                .py(py)?;
            let known: Vec<usize> = plans.iter().map(|p| p.tokens.start).collect();
            // Blocking with the GIL held is safe: no core call waits for the GIL under a lock.
            let Some(pairs) = mgr
                .append_planned(&handles, &known, &tokens, &keys)
                .py(py)?
            else {
                // Refused, nothing changed (a planned step needs no block: not reached).
                return Err(internal("planned steps did not fit")).py(py);
            };
            drop(handles);
            // Appended: the steps are done.
            for (st, plan) in states.iter_mut().zip(&plans) {
                st.primed = None;
                st.primed_key = None;
                st.rec.known = plan.end;
                st.rec.scheduled = plan.end;
                if !plan.keys.is_empty() {
                    st.rec.keys = plan.keys.end;
                }
            }
            queued.del_slice(0, n)?;
            if !pairs.is_empty() {
                return Err(internal("planned steps copied blocks")).py(py);
            }
        } else {
            queued.del_slice(0, n)?;
        }
        // Relaxed: statistics.
        self.applied.fetch_add(plans.len(), Ordering::Relaxed);
        self.skipped.fetch_add(skipped, Ordering::Relaxed);
        Ok(())
    }
}

#[pymethods]
impl PyDeferredDecodes {
    #[new]
    fn new(records: Bound<'_, PyDict>) -> Self {
        let py = records.py();
        Self {
            records: records.unbind(),
            primed: PyDict::new(py).unbind(),
            queued: PyList::empty(py).unbind(),
            busy: Mutex::new(()),
            skipped: AtomicUsize::new(0),
            applied: AtomicUsize::new(0),
        }
    }

    /// request id -> the computed tokens its planned step expects. The adapter's
    /// `allocate_slots` pops the request's entry and, when its call is the planned step,
    /// appends the request id to `queued` and answers "no new block".
    #[getter]
    fn planned(&self, py: Python<'_>) -> Py<PyDict> {
        self.primed.clone_ref(py)
    }

    /// The request ids whose planned step was answered and not applied yet.
    #[getter]
    fn taken(&self, py: Python<'_>) -> Py<PyList> {
        self.queued.clone_ref(py)
    }

    /// Apply the queued steps (the plans of the others stay).
    fn apply(&self, py: Python<'_>) -> PyResult<()> {
        // Busy taken even with nothing queued: another thread may be applying steps it took
        // from the queue, and the caller must find them applied.
        self.apply_all(py)
    }

    /// Forget every plan, then apply the queued steps: before any call of the adapter but
    /// a planned step's own.
    fn settle(&self, py: Python<'_>) -> PyResult<()> {
        let primed = self.primed.bind(py);
        if !primed.is_empty() {
            primed.clear();
        }
        // Taken even with nothing queued (`apply`).
        let _busy = self.busy(py);
        self.apply_queued(py)
    }

    /// Settle, then plan the next step of every record whose step writes in place. Returns
    /// how many were planned. `keyed`: steps that fill their block and hand over its key
    /// may be planned too (the adapter passes False while it publishes KV events: a key's
    /// event is written by the step's own call).
    #[pyo3(signature = (keyed = true))]
    fn prime(&self, py: Python<'_>, keyed: bool) -> PyResult<usize> {
        let _busy = self.busy(py);
        self.primed.bind(py).clear();
        self.apply_queued(py)?;
        let primed = self.primed.bind(py);
        // A copy of the entries: a record's lock may release the GIL while it waits, and
        // another thread may then add or remove records.
        let entries: Vec<_> = self.records.bind(py).iter().collect();
        for (rid, rec) in entries {
            if let Some(computed) = rec.cast::<PyEngineRecord>()?.get().prime(py, keyed)? {
                primed.set_item(rid, computed)?;
            }
        }
        Ok(primed.len())
    }

    /// Steps taken and not applied yet.
    #[getter]
    fn queued(&self, py: Python<'_>) -> usize {
        self.queued.bind(py).len()
    }

    /// Steps planned and not taken yet.
    #[getter]
    fn primed(&self, py: Python<'_>) -> usize {
        self.primed.bind(py).len()
    }

    /// Steps applied since the start.
    #[getter]
    fn applied(&self) -> usize {
        // Relaxed: a statistic.
        self.applied.load(Ordering::Relaxed)
    }

    /// Queued steps skipped when applied (`skipped`).
    #[getter]
    fn skipped(&self) -> usize {
        // Relaxed: a statistic.
        self.skipped.load(Ordering::Relaxed)
    }
}
