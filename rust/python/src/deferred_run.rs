//! A record's run of deferred one-token steps (`Run`): planned, and planned on after each
//! step the engine took (`DeferredDecodes` calls these with its `busy` lock held).

use crate::engine_record::{PyEngineRecord, Run, State};
use pagedkv_core::DecodeCall;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::atomic::Ordering;

/// What `plan_run` found.
pub(crate) enum Planned {
    /// The record's run holds answered steps not applied: it goes on as it is.
    Running,
    /// A run planned: the computed tokens its first call must say.
    At(usize),
    /// Nothing planned (its next call takes the general path).
    Nothing,
}

impl PyEngineRecord {
    /// The request's token buffer, unless `decode` found it replaced (then nothing is
    /// planned for the record).
    fn live_tokens(&self) -> Option<&Py<PyAny>> {
        // Relaxed: a flag set and read under the GIL.
        self.tokens
            .as_ref()
            .filter(|_| !self.tokens_replaced.load(Ordering::Relaxed))
    }

    /// Plan the record's next steps as vLLM's decodes of a running request (its next known
    /// token, no lookahead) where they write in place: a run of them to the end of the block
    /// (`BlockManager::in_place_end`), or the one step that fills the block and hands over
    /// its key (`keyed`: the adapter says no while it must publish the key's event from the
    /// step itself). Returns the computed tokens the first planned call must say, else None
    /// (no run). Reads the record and the request's token list only (and its block hashes
    /// once a block, for a key): the request object itself is cold at the step's start, and
    /// its counters are the record's in a steady decode. A record whose run holds steps
    /// answered and not applied is left as it is (`Planned::Running`).
    pub(crate) fn plan_run(&self, py: Python<'_>, keyed: bool, epoch: u64) -> PyResult<Planned> {
        let mut st = self.state(py);
        if st.pending() > 0 {
            return Ok(Planned::Running);
        }
        st.end_run()?;
        let Some(tokens) = self.live_tokens() else {
            return Ok(Planned::Nothing);
        };
        let mgr = &self.mgr.get().inner;
        let num_tokens = tokens.bind(py).len()?;
        let bs = mgr.block_size();
        let caching = mgr.config().enable_prefix_caching;
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
            return Ok(Planned::Nothing);
        };
        let mut key = None;
        if !plan.keys.is_empty() {
            if !keyed {
                return Ok(Planned::Nothing);
            }
            let hashes = self.request.bind(py).getattr(intern!(py, "block_hashes"))?;
            plan.limit_keys(hashes.len()? / self.hash_ratio);
            if plan.keys.len() == 1 {
                let item = hashes.get_item((plan.keys.start + 1) * self.hash_ratio - 1)?;
                // Not bytes: the general path's call says what is wrong.
                let Ok(bytes) = item.cast::<PyBytes>() else {
                    return Ok(Planned::Nothing);
                };
                key = Some((bytes.as_bytes().to_vec(), plan.keys.end));
            }
        }
        if !plan.is_one_token_keyed(st.rec.table_len, bs) {
            return Ok(Planned::Nothing);
        }
        let st = &mut *st;
        if st.handle.is_none() {
            // A record whose sequence is gone is not planned: its call takes the general
            // path, which says what is wrong.
            match mgr.seq_handle(st.rec.seq) {
                Ok(h) => st.handle = Some(h),
                Err(_) => return Ok(Planned::Nothing),
            }
        }
        let Some(h) = st.handle.as_ref() else {
            return Ok(Planned::Nothing);
        };
        if !mgr.decode_in_place(&st.rec, h, &plan).unwrap_or(false) {
            return Ok(Planned::Nothing);
        }
        let end = if key.is_some() {
            computed + 1
        } else {
            mgr.in_place_end(&st.rec, &plan)
        };
        st.run = Some(Run {
            epoch,
            taken_to: computed,
            end,
            key,
        });
        Ok(Planned::At(computed))
    }

    /// After the engine took the run's planned step (and maybe more, applied or not): the
    /// position its next call must say, while the run goes on in place and the request
    /// already knows that position's token; else None (the run is done: its steps are
    /// applied and the record planned afresh). `epoch`: the current one.
    pub(crate) fn plan_on(&self, py: Python<'_>, epoch: u64) -> PyResult<Option<usize>> {
        let st = self.state(py);
        self.next_of(py, &st, epoch)
    }

    /// `plan_on` with the record's state locked by the caller.
    pub(crate) fn next_of(
        &self,
        py: Python<'_>,
        st: &State,
        epoch: u64,
    ) -> PyResult<Option<usize>> {
        let Some(run) = st.run.as_ref() else {
            return Ok(None);
        };
        if run.epoch != epoch || run.key.is_some() || run.taken_to >= run.end {
            return Ok(None);
        }
        let Some(tokens) = self.live_tokens() else {
            return Ok(None);
        };
        // The step decodes a known token: the request must hold it already (an engine that
        // schedules ahead of its outputs calls with a placeholder: the general path's).
        let next = run.taken_to;
        if tokens.bind(py).len()? <= next {
            return Ok(None);
        }
        Ok(Some(next))
    }
}
