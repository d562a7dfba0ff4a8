//! `pagedkv._core.DeferredDecodes`: the one-token decode steps of an engine adapter answered
//! at once and applied to their sequences later, in batches (the core's `decode_in_place`
//! and `in_place_end` say which steps qualify).
//!
//! vLLM's scheduler asks for a running request's slots one request at a time, with its own
//! bookkeeping in between; each call then finds the request's record and sequence cold. Most
//! of those steps write one token into a slot the sequence already holds, so their answer
//! ("no new block") is known before the step. `prime`, at the start of each step, plans for
//! each record a run of such steps (`Run`: to the end of its block, or the one step that
//! fills the block and hands over its key); the scheduler's call (the adapter's Python,
//! which pops the request's entry of `planned` and appends its id to `taken`: two dict and
//! list operations, cheaper than any call into Rust) only checks that the call is the
//! planned one. The next `prime` moves each taken run on to its next step (`plan_on`), and
//! applies tokens only where it must: the steps that hand over a key (at once, in call
//! order: their blocks register as the engine's do), and the runs that reached their end
//! (then planned afresh). A run's other steps stay answered and not applied, so a steady
//! decode touches each sequence once a block, not once a step.
//!
//! Every other call of the adapter settles first (`settle`: every answered step applied,
//! every plan forgotten and every run ended by moving the epoch on), and the adapter's
//! general `allocate_slots` path applies the answered steps first (`apply`), so no call
//! observes a sequence without a step already answered.

use crate::deferred_apply::apply_runs;
use crate::deferred_run::Planned;
use crate::engine_record::PyEngineRecord;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// What `busy` guards: the runs between the adapter's calls.
#[derive(Default)]
struct Runs {
    /// Moved on by every settle (wrapping: only equality with a run's is asked, and a run
    /// planned 2**64 settles ago is long over): a run planned in an earlier epoch is over.
    epoch: u64,
    /// The records whose runs may hold steps answered and not applied: every one that does
    /// is here, once (`State::listed`); one applied by `prime` stays until the list is
    /// applied and emptied. A keyed step is never waiting: it is applied when taken in.
    pending: Vec<Py<PyEngineRecord>>,
    /// The records whose run's step was taken since the last `prime`, with their request
    /// ids: `prime` plans their next step (`plan_on`).
    moved: Vec<(Py<PyAny>, Py<PyEngineRecord>)>,
}

/// One adapter's deferred one-token steps. The dictionary and the list are Python objects,
/// changed only with the GIL held; `busy` makes a call that applies steps wait for one in
/// progress (which may release the GIL while it waits for a record), so that its caller
/// then finds every step answered before its call applied.
#[pyclass(frozen, module = "pagedkv._core", name = "DeferredDecodes")]
pub struct PyDeferredDecodes {
    /// request id -> the adapter's record (`EngineRecord`): the adapter's own dict.
    records: Py<PyDict>,
    /// request id -> the computed tokens its planned step expects; an entry exists only
    /// while its record's run plans that step (a record's other changes come through the
    /// adapter, which settles first, emptying this).
    primed: Py<PyDict>,
    /// request ids whose planned step was taken and not yet moved into its run, in call
    /// order.
    queued: Py<PyList>,
    /// Held while steps are taken in, applied or planned.
    busy: Mutex<Runs>,
    /// Taken steps found without their record or run (only a race of two threads on one
    /// request does that; the tests assert it stays 0).
    skipped: AtomicUsize,
    /// Steps applied since the start (a statistic for tests and benchmarks).
    applied: AtomicUsize,
}

impl PyDeferredDecodes {
    fn busy(&self, py: Python<'_>) -> MutexGuard<'_, Runs> {
        loop {
            match self.busy.try_lock() {
                Ok(g) => return g,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => py.detach(|| drop(self.busy.lock())),
            }
        }
    }

    /// `apply_for` (the record's own `decode` calls it).
    pub(crate) fn apply_for_record(
        &self,
        py: Python<'_>,
        record: Option<&PyEngineRecord>,
    ) -> PyResult<()> {
        let mut runs = self.busy(py);
        self.take_in(py, &mut runs, None, &mut Vec::new())?;
        if let Some(rec) = record {
            let applied = apply_runs(py, &[rec], false)?;
            // Relaxed: a statistic.
            self.applied.fetch_add(applied, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `apply`: every step taken so far applied (waiting for an apply in progress).
    pub(crate) fn apply_all(&self, py: Python<'_>) -> PyResult<()> {
        let mut runs = self.busy(py);
        self.take_in(py, &mut runs, None, &mut Vec::new())?;
        self.apply_pending(py, &mut runs)
    }

    /// Move the taken steps (`queued`) into their records' runs, in call order, and apply
    /// the keyed ones among them (in that order, right after the steps their records took
    /// before). The caller holds `busy`. `renew`: at a
    /// step's start, the `planned` dict and the epoch: each run's next step is planned at
    /// once, and the runs that reached their end go to `done`; else they wait in `moved`.
    fn take_in<'py>(
        &self,
        py: Python<'py>,
        runs: &mut Runs,
        renew: Option<(&Bound<'py, PyDict>, u64)>,
        done: &mut Vec<Bound<'py, PyEngineRecord>>,
    ) -> PyResult<()> {
        let queued = self.queued.bind(py);
        let n = queued.len();
        if n == 0 {
            return Ok(());
        }
        // Everything that can fail before anything changes: the records looked up, then the
        // queue emptied. After that each step is counted into its run, and its record
        // listed (`Runs::pending`), before anything else can fail: a later error leaves
        // every taken step where an apply finds it.
        let records = self.records.bind(py);
        let mut found = Vec::with_capacity(n);
        for rid in queued.iter().take(n) {
            // Without its record: its request was freed between the answer and now (a race
            // of two threads on one request; the answer, "no new block", was right when
            // given).
            if let Some(rec) = records.get_item(&rid)? {
                found.push((rid, rec.cast_into::<PyEngineRecord>()?));
            }
        }
        queued.del_slice(0, n)?;
        let mut skipped = n - found.len();
        let mut keyed = Vec::new();
        let mut taken = Vec::with_capacity(found.len());
        for (rid, rec) in found {
            let mut st = rec.get().state(py);
            // Without a run: changed by a call that caught its tokens up itself (the same
            // race).
            let Some(run) = st.run.as_mut().filter(|r| r.taken_to < r.end) else {
                skipped += 1;
                continue;
            };
            run.taken_to += 1;
            let is_keyed = run.key.is_some();
            if !st.listed {
                st.listed = true;
                runs.pending.push(rec.clone().unbind());
            }
            if is_keyed {
                drop(st);
                keyed.push(rec);
            } else {
                // The run's next step, read under the same lock (its error raised below,
                // once every step is counted).
                let next = renew.map(|(_, epoch)| rec.get().next_of(py, &st, epoch));
                drop(st);
                taken.push((rid, rec, next));
            }
        }
        // Relaxed: statistics.
        self.skipped.fetch_add(skipped, Ordering::Relaxed);
        let keyed: Vec<&PyEngineRecord> = keyed.iter().map(|r| r.get()).collect();
        let applied = apply_runs(py, &keyed, false)?;
        self.applied.fetch_add(applied, Ordering::Relaxed);
        for (rid, rec, next) in taken {
            match (renew, next) {
                (Some((planned, _)), Some(next)) => match next? {
                    Some(next) => planned.set_item(rid, next)?,
                    None => done.push(rec),
                },
                _ => runs.moved.push((rid.unbind(), rec.unbind())),
            }
        }
        Ok(())
    }

    /// Apply every run's answered steps. The caller holds `busy` and took `queued` in.
    fn apply_pending(&self, py: Python<'_>, runs: &mut Runs) -> PyResult<()> {
        if runs.pending.is_empty() {
            return Ok(());
        }
        let recs: Vec<&PyEngineRecord> = runs.pending.iter().map(|r| r.get()).collect();
        let applied = apply_runs(py, &recs, true)?;
        runs.pending.clear();
        // Relaxed: a statistic.
        self.applied.fetch_add(applied, Ordering::Relaxed);
        Ok(())
    }
}

#[pymethods]
impl PyDeferredDecodes {
    /// `epoch`: where the settles' count starts (for tests of its wrap; it only has to
    /// differ from the count a run was planned at).
    #[new]
    #[pyo3(signature = (records, *, epoch = 0))]
    fn new(records: Bound<'_, PyDict>, epoch: u64) -> Self {
        let py = records.py();
        Self {
            records: records.unbind(),
            primed: PyDict::new(py).unbind(),
            queued: PyList::empty(py).unbind(),
            busy: Mutex::new(Runs {
                epoch,
                ..Runs::default()
            }),
            skipped: AtomicUsize::new(0),
            applied: AtomicUsize::new(0),
        }
    }

    /// request id -> the computed tokens its planned step expects. The adapter's
    /// `allocate_slots` pops the request's entry and, when its call is the planned step,
    /// appends the request id to `taken` and answers "no new block".
    #[getter]
    fn planned(&self, py: Python<'_>) -> Py<PyDict> {
        self.primed.clone_ref(py)
    }

    /// The request ids whose planned step was answered and not taken in yet.
    #[getter]
    fn taken(&self, py: Python<'_>) -> Py<PyList> {
        self.queued.clone_ref(py)
    }

    /// Apply every answered step (the plans stay).
    fn apply(&self, py: Python<'_>) -> PyResult<()> {
        // Busy taken even with nothing queued: another thread may be applying steps it took
        // in, and the caller must find them applied.
        self.apply_all(py)
    }

    /// Take the answered steps in, applying those that hand over a key (in call order),
    /// and apply `record`'s own answered steps (if given); the other runs go on. Enough for
    /// a call that touches only `record`'s sequence, the pool and the cached blocks: the
    /// other runs' steps write into blocks their sequences alone hold, which are neither
    /// cached nor free, and register nothing.
    #[pyo3(signature = (record = None))]
    fn apply_for(&self, py: Python<'_>, record: Option<Bound<'_, PyEngineRecord>>) -> PyResult<()> {
        self.apply_for_record(py, record.as_ref().map(Bound::get))
    }

    /// `apply_for(record)`, then end its run: before its request is freed (no other run is
    /// touched; the record stays listed with nothing to apply until the list empties).
    fn release(&self, py: Python<'_>, record: Bound<'_, PyEngineRecord>) -> PyResult<()> {
        self.apply_for_record(py, Some(record.get()))?;
        record.get().state(py).end_run()
    }

    /// Forget every plan and end every run, then apply every answered step: before any
    /// call of the adapter but a planned step's own.
    fn settle(&self, py: Python<'_>) -> PyResult<()> {
        let primed = self.primed.bind(py);
        if !primed.is_empty() {
            primed.clear();
        }
        // Taken even with nothing queued (`apply`).
        let mut runs = self.busy(py);
        runs.epoch = runs.epoch.wrapping_add(1);
        runs.moved.clear();
        self.take_in(py, &mut runs, None, &mut Vec::new())?;
        runs.moved.clear();
        self.apply_pending(py, &mut runs)
    }

    /// At a step's start: take the answered steps in (applying those that hand over a
    /// key), plan on each run whose step was taken, apply the runs that reached their end,
    /// and plan a run for every record without one. Returns how many steps are planned.
    /// `keyed`: steps that fill their block and hand over its key may be planned too (the
    /// adapter passes False while it publishes KV events: a key's event is written by the
    /// step's own call).
    #[pyo3(signature = (keyed = true))]
    fn prime(&self, py: Python<'_>, keyed: bool) -> PyResult<usize> {
        let mut runs = self.busy(py);
        let primed = self.primed.bind(py);
        let epoch = runs.epoch;
        // Runs that go on: their next step planned. The others reached their end: applied.
        // First those taken in by an `apply` since the last step's start.
        let mut done = Vec::new();
        for (rid, rec) in std::mem::take(&mut runs.moved) {
            let rec = rec.into_bound(py);
            match rec.get().plan_on(py, epoch)? {
                Some(next) => primed.set_item(rid, next)?,
                None => done.push(rec),
            }
        }
        self.take_in(py, &mut runs, Some((primed, epoch)), &mut done)?;
        if !done.is_empty() {
            // They stay listed (`Runs::pending`) with nothing to apply.
            let done: Vec<&PyEngineRecord> = done.iter().map(|r| r.get()).collect();
            let applied = apply_runs(py, &done, false)?;
            // Relaxed: a statistic.
            self.applied.fetch_add(applied, Ordering::Relaxed);
        }
        // A fresh run for every record whose run holds no answered step (none, over, or
        // planned and not taken: planned again from where the record is). A copy of the
        // entries: a record's lock may release the GIL while it waits, and another thread
        // may then add or remove records.
        let entries: Vec<_> = self.records.bind(py).iter().collect();
        for (rid, rec) in entries {
            let rec = rec.cast_into::<PyEngineRecord>()?;
            match rec.get().plan_run(py, keyed, epoch)? {
                Planned::Running => {}
                Planned::At(computed) => primed.set_item(rid, computed)?,
                Planned::Nothing => {
                    if primed.contains(&rid)? {
                        primed.del_item(&rid)?;
                    }
                }
            }
        }
        Ok(primed.len())
    }

    /// Steps taken and not taken in yet.
    #[getter]
    fn queued(&self, py: Python<'_>) -> usize {
        self.queued.bind(py).len()
    }

    /// Steps planned and not taken yet.
    #[getter]
    fn primed(&self, py: Python<'_>) -> usize {
        self.primed.bind(py).len()
    }

    /// Steps answered and not applied yet (taken in or not).
    #[getter]
    fn unapplied(&self, py: Python<'_>) -> PyResult<usize> {
        let runs = self.busy(py);
        let mut n = self.queued.bind(py).len();
        for rec in &runs.pending {
            n += rec.get().state(py).pending();
        }
        Ok(n)
    }

    /// Steps applied since the start.
    #[getter]
    fn applied(&self) -> usize {
        // Relaxed: a statistic.
        self.applied.load(Ordering::Relaxed)
    }

    /// Taken steps skipped when taken in (`skipped`).
    #[getter]
    fn skipped(&self) -> usize {
        // Relaxed: a statistic.
        self.skipped.load(Ordering::Relaxed)
    }
}
