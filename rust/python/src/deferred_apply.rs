//! The answered steps of records' runs (`Run`) appended to their sequences: the steps that
//! hand over a key together, in the order given (one core call, `append_planned`: their
//! blocks register in that order, as the engine's), then each other run's steps at once
//! (`append_run`). Both check that every sequence is where its steps start.

use crate::engine_record::{token_at, PyEngineRecord, State};
use crate::errors::IntoPy;
use pagedkv_core::Error;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use std::ops::Range;
use std::sync::MutexGuard;

fn internal(what: &str) -> Error {
    Error::Invariant(format!("pagedkv.vllm deferred decode: {what}"))
}

/// Tokens `range` of a request's token buffer (`PyEngineRecord::tokens`).
fn tokens_in(tokens: &Bound<'_, PyAny>, range: Range<usize>) -> PyResult<Vec<u32>> {
    if let Ok(list) = tokens.cast::<PyList>() {
        return range.map(|i| token_at(list.as_any(), i)).collect();
    }
    let buf = PyBuffer::<i32>::get(tokens)?;
    let cells = buf
        .as_slice(tokens.py())
        .and_then(|s| s.get(range.clone()))
        .ok_or_else(|| {
            PyIndexError::new_err(format!("tokens {range:?} of the request's buffer"))
        })?;
    cells
        .iter()
        .map(|c| {
            u32::try_from(c.get()).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!("token id {}", c.get()))
            })
        })
        .collect()
}

/// Append every answered step of `recs`' runs; returns how many. The keyed steps (a keyed
/// run is its one step) go first, together, in the order of `recs` (the callers give the
/// engine's call order). An error leaves what was applied before it applied and the rest
/// answered, each record's counters where its sequence is. `unlist`: the records leave
/// `DeferredDecodes`'s list (`State::listed`), which the caller then empties.
pub(crate) fn apply_runs(
    py: Python<'_>,
    recs: &[&PyEngineRecord],
    unlist: bool,
) -> PyResult<usize> {
    let Some(first) = recs.first() else {
        return Ok(0);
    };
    let mgr = &first.mgr.get().inner;
    // A record twice would wait for its own lock.
    let mut seen = std::collections::HashSet::with_capacity(recs.len());
    if !recs.iter().all(|r| seen.insert(std::ptr::from_ref(*r))) {
        return Err(internal("a record listed twice")).py(py);
    }
    let mut states: Vec<MutexGuard<'_, State>> = Vec::with_capacity(recs.len());
    for rec in recs {
        states.push(rec.state(py));
    }
    let buffer = |i: usize| {
        recs[i]
            .tokens
            .as_ref()
            .map(|t| t.bind(py).clone())
            .ok_or_else(|| internal("a run without the request's tokens"))
            .py(py)
    };
    let keyed = |st: &State| st.run.as_ref().is_some_and(|r| r.key.is_some());
    let mut applied = 0;
    // The keyed steps, together and in order.
    let due: Vec<usize> = (0..recs.len())
        .filter(|&i| states[i].pending() > 0 && keyed(&states[i]))
        .collect();
    if !due.is_empty() {
        let (mut tokens, mut keys, mut known) = (Vec::new(), Vec::new(), Vec::new());
        for &i in &due {
            let st = &states[i];
            if st.pending() != 1 {
                return Err(internal("a keyed run of more than one step")).py(py);
            }
            tokens.push(token_at(&buffer(i)?, st.rec.known)?);
            known.push(st.rec.known);
            keys.push(
                st.run
                    .as_ref()
                    .and_then(|r| r.key.as_ref())
                    .map(|k| k.0.clone()),
            );
        }
        let handles = due
            .iter()
            .map(|&i| {
                states[i]
                    .handle
                    .as_ref()
                    .ok_or_else(|| internal("a run without a sequence"))
            })
            .collect::<Result<Vec<_>, _>>()
            .py(py)?;
        // Blocking with the GIL held is safe: no core call waits for the GIL under a lock.
        let Some(pairs) = mgr
            .append_planned(&handles, &known, &tokens, &keys)
            .py(py)?
        else {
            // Refused, nothing changed (a planned step needs no block: not reached).
            return Err(internal("planned steps did not fit")).py(py);
        };
        drop(handles);
        for &i in &due {
            let st = &mut *states[i];
            st.rec.known += 1;
            st.rec.scheduled = st.rec.known;
            if let Some((_, keys_end)) = st.run.as_ref().and_then(|r| r.key.as_ref()) {
                st.rec.keys = *keys_end;
            }
        }
        applied += due.len();
        if !pairs.is_empty() {
            return Err(internal("planned steps copied blocks")).py(py);
        }
    }
    // Each other run's steps at once.
    for (i, st) in states.iter_mut().enumerate() {
        let st = &mut **st;
        let n = st.pending();
        if n == 0 {
            continue;
        }
        let tokens = tokens_in(&buffer(i)?, st.rec.known..st.rec.known + n)?;
        let State { rec, handle, .. } = st;
        let handle = handle
            .as_ref()
            .ok_or_else(|| internal("a run without a sequence"))
            .py(py)?;
        mgr.append_run(rec, handle, &tokens).py(py)?;
        applied += n;
    }
    if unlist {
        for st in &mut states {
            st.listed = false;
        }
    }
    Ok(applied)
}
