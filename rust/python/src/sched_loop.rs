//! `pagedkv._core.schedule_replay`: pagedkv-sim's scheduling loop (`run_schedule`) over a
//! `BlockManager`, for `pagedkv.sim.rust_loop`. Argument and result conversion only; the
//! loop runs with the GIL released, taking it back after every step to call `progress` and
//! check for Ctrl-C.

use crate::convert::{batch_tokens, int_arg, seq_ids, u64_arg};
use crate::errors::{invalid, to_pyerr};
use crate::manager::{pairs_array, salt_arg, PyBlockManager};
use crate::mrc::PyMrcStream;
use crate::objects::alloc_status;
use numpy::IntoPyArray;
use pagedkv_sim::{
    run_schedule, Answer, Call, Counters, LoopError, Options, Prompt, Request, Series, StopRule,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::collections::HashMap;

/// One request: `(request_id, prompt_tokens or None, hash_ids or None, hash_block_tokens,
/// prompt_len, max_new_tokens, num_samples, cache_salt, root, arrival_step, after, delay)`.
fn request_arg(item: &Bound<'_, PyAny>) -> PyResult<Request> {
    let t = item
        .cast::<PyTuple>()
        .map_err(|_| invalid(item.py(), "each request must be a 12-tuple"))?;
    if t.len() != 12 {
        return Err(invalid(item.py(), "each request must be a 12-tuple"));
    }
    let count = |i: usize, what: &str| -> PyResult<u64> {
        Ok(int_arg(&t.get_item(i)?, what, 0, i64::MAX)? as u64)
    };
    let tokens = t.get_item(1)?;
    let prompt = if tokens.is_none() {
        Prompt::HashIds {
            ids: seq_ids(&t.get_item(2)?)?,
            block_tokens: int_arg(&t.get_item(3)?, "hash_block_tokens", 1, 1 << 20)? as usize,
        }
    } else {
        Prompt::Tokens(batch_tokens(&tokens)?)
    };
    let after = t.get_item(10)?;
    Ok(Request {
        id: count(0, "request_id")?,
        prompt,
        prompt_len: count(4, "prompt_len")? as usize,
        max_new_tokens: count(5, "max_new_tokens")? as usize,
        samples: count(6, "num_samples")? as usize,
        cache_salt: salt_arg(Some(&t.get_item(7)?).filter(|s| !s.is_none()))?,
        root: u64_arg(&t.get_item(8)?, "root")?,
        arrival_step: count(9, "arrival_step")?,
        after: if after.is_none() {
            None
        } else {
            Some(int_arg(&after, "after", 0, i64::MAX)? as u64)
        },
        delay: count(11, "delay")?,
    })
}

/// `(target_hits, prompt_tokens, rest or None)`.
fn stop_arg(obj: &Bound<'_, PyAny>) -> PyResult<StopRule> {
    let (target_hits, prompt_tokens, rest): (f64, u64, Option<HashMap<u64, u64>>) =
        obj.extract()?;
    Ok(StopRule {
        target_hits,
        prompt_tokens,
        rest,
    })
}

fn counters_dict<'py>(py: Python<'py>, c: &Counters) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let items: [(&str, u64); 25] = [
        ("requests", c.requests),
        ("finished_requests", c.finished_requests),
        ("rejected_requests", c.rejected_requests),
        ("steps", c.steps),
        ("clock_steps", c.clock_steps),
        ("finished_sequences", c.finished_sequences),
        ("rejected_sequences", c.rejected_sequences),
        ("forks", c.forks),
        ("preempted_recompute", c.preempted_recompute),
        ("preempted_swap", c.preempted_swap),
        ("swap_ins", c.swap_ins),
        ("prompt_tokens", c.prompt_tokens),
        ("prefix_hit_tokens", c.prefix_hit_tokens),
        ("recomputed_tokens", c.recomputed_tokens),
        ("recomputed_hit_tokens", c.recomputed_hit_tokens),
        ("decode_tokens", c.decode_tokens),
        ("output_tokens", c.output_tokens),
        ("copy_pairs", c.copy_pairs),
        ("prefill_chunks", c.prefill_chunks),
        ("extend_calls", c.extend_calls),
        ("chunked_prompts", c.chunked_prompts),
        ("scheduled_tokens", c.scheduled_tokens),
        ("decode_steps", c.decode_steps),
        ("manager_calls", c.manager_calls),
        ("manager_ns", c.manager_ns),
    ];
    for (k, v) in items {
        d.set_item(k, v)?;
    }
    d.set_item("stopped_early", c.stopped_early)?;
    Ok(d)
}

fn series_dict<'py>(py: Python<'py>, s: Series) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let ints: [(&str, Vec<u64>); 8] = [
        ("step", s.step),
        ("cached_blocks", s.cached_blocks),
        ("running", s.running),
        ("waiting", s.waiting),
        ("swapped", s.swapped),
        ("manager_ns", s.manager_ns),
        ("scheduled_tokens", s.scheduled_tokens),
        ("live_tokens", s.live_tokens),
    ];
    for (k, v) in ints {
        d.set_item(k, v)?;
    }
    d.set_item("preemptions", s.preemptions)?;
    d.set_item("usage", s.usage)?;
    d.set_item("hit_rate", s.hit_rate)?;
    d.set_item("fragmentation", s.fragmentation)?;
    Ok(d)
}

/// A logged call as `TimedCalls` records one: `(name, args, kwargs, answer)`.
fn logged<'py>(
    py: Python<'py>,
    call: Call,
    answer: Answer,
    salts: &[Py<PyAny>],
) -> PyResult<Bound<'py, PyTuple>> {
    let kw = PyDict::new(py);
    let u32s = |v: Vec<u32>| -> Bound<'py, PyAny> { v.into_pyarray(py).into_any() };
    let i64s = |v: Vec<u64>| -> Bound<'py, PyAny> {
        let v: Vec<i64> = v.into_iter().map(|x| x as i64).collect();
        v.into_pyarray(py).into_any()
    };
    let (name, args): (&str, Bound<'py, PyTuple>) = match call {
        Call::CanSwapIn(id) => ("can_swap_in", PyTuple::new(py, [id])?),
        Call::SwapIn(id) => ("swap_in", PyTuple::new(py, [id])?),
        Call::SwapOut(id) => ("swap_out", PyTuple::new(py, [id])?),
        Call::CanAllocateCount(n) => ("can_allocate", PyTuple::new(py, [n])?),
        Call::CanAllocate {
            tokens,
            chunk,
            request,
        } => {
            kw.set_item("num_new_tokens", chunk)?;
            kw.set_item("cache_salt", salts[request].bind(py))?;
            ("can_allocate", PyTuple::new(py, [u32s(tokens)])?)
        }
        Call::Allocate {
            seq_id,
            tokens,
            chunk,
            request,
        } => {
            kw.set_item("cache_salt", salts[request].bind(py))?;
            kw.set_item("num_new_tokens", chunk)?;
            let id = seq_id.into_pyobject(py)?.into_any();
            ("allocate", PyTuple::new(py, [id, u32s(tokens)])?)
        }
        Call::Extend(id, k) => ("extend", PyTuple::new(py, [id, k as u64])?),
        Call::AppendBatch(ids, toks) => {
            ("append_batch", PyTuple::new(py, [i64s(ids), u32s(toks)])?)
        }
        Call::Free(id, c) => {
            if let Some(c) = c {
                kw.set_item("num_computed_tokens", c)?;
            }
            ("free", PyTuple::new(py, [id])?)
        }
        Call::FreeBatch(ids) => ("free_batch", PyTuple::new(py, [i64s(ids)])?),
        Call::Fork(p, c) => ("fork", PyTuple::new(py, [p, c])?),
    };
    let append_batch = name == "append_batch";
    let out: Bound<'py, PyAny> = match answer {
        Answer::Status(s) => alloc_status(py, s)?,
        Answer::Hit(h) => h.into_pyobject(py)?.into_any(),
        Answer::Pairs(None) | Answer::Done => py.None().into_bound(py),
        Answer::Pairs(Some(p)) if append_batch => pairs_array(py, p)?.into_any(),
        Answer::Pairs(Some(p)) => PyList::new(py, p)?.into_any(),
    };
    PyTuple::new(
        py,
        [
            name.into_pyobject(py)?.into_any(),
            args.into_any(),
            kw.into_any(),
            out,
        ],
    )
}

fn loop_err(py: Python<'_>, e: LoopError, waiting: Option<PyErr>) -> PyErr {
    match e {
        LoopError::Stopped => waiting.unwrap_or_else(|| PyRuntimeError::new_err("stopped")),
        LoopError::Core(e) => to_pyerr(py, e),
        LoopError::NoProgress => PyRuntimeError::new_err(e.to_string()),
        other => invalid(py, other.to_string()),
    }
}

/// Replay `requests` through `manager` with chunked prefill (pagedkv-sim's `run_schedule`).
/// Returns `{"counters", "series", "log"}` (`counters`: `SimResult`'s counters and the
/// budget options, by name); `log` (with `record`): every manager call as
/// `(name, args, kwargs, answer)`, else None.
#[pyfunction]
#[pyo3(signature = (manager, requests, *, max_batch, max_num_batched_tokens,
    long_prefill_token_threshold, skip_sure_checks, record, watches, progress, stop))]
#[allow(clippy::too_many_arguments)]
pub fn schedule_replay<'py>(
    py: Python<'py>,
    manager: &Bound<'py, PyBlockManager>,
    requests: &Bound<'py, PyAny>,
    max_batch: &Bound<'py, PyAny>,
    max_num_batched_tokens: &Bound<'py, PyAny>,
    long_prefill_token_threshold: &Bound<'py, PyAny>,
    skip_sure_checks: bool,
    record: bool,
    watches: Vec<Bound<'py, PyMrcStream>>,
    progress: Option<Bound<'py, PyAny>>,
    stop: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut reqs = Vec::new();
    let mut salts = Vec::new();
    for item in requests.try_iter()? {
        let item = item?;
        reqs.push(request_arg(&item)?);
        salts.push(item.get_item(7)?.unbind());
    }
    let options = Options {
        max_batch: int_arg(max_batch, "max_batch", 1, i64::MAX)? as usize,
        budget: int_arg(
            max_num_batched_tokens,
            "max_num_batched_tokens",
            1,
            i64::MAX,
        )? as usize,
        long_prefill_token_threshold: int_arg(
            long_prefill_token_threshold,
            "long_prefill_token_threshold",
            0,
            i64::MAX,
        )? as usize,
        skip_sure_checks,
        record,
        stop: stop.filter(|s| !s.is_none()).map(stop_arg).transpose()?,
    };
    let mut borrowed = Vec::with_capacity(watches.len());
    for w in &watches {
        borrowed.push(w.try_borrow_mut()?);
    }
    let streams = borrowed.iter_mut().map(|b| &mut b.inner).collect();
    let progress: Option<Py<PyAny>> = progress.map(Bound::unbind);
    let mut waiting: Option<PyErr> = None;
    // The GIL is released while the loop runs (the core calls may wait for a lock, as the
    // binding never does holding the GIL) and taken back after every step for the hook.
    let mut hook = |done: u64, total: u64| -> bool {
        let out = Python::attach(|py| {
            py.check_signals()?;
            match &progress {
                Some(p) => p.call1(py, (done, total)).map(|_| ()),
                None => Ok(()),
            }
        });
        match out {
            Ok(()) => true,
            Err(e) => {
                waiting = Some(e);
                false
            }
        }
    };
    let mgr = &manager.get().inner;
    let run = py.detach(|| run_schedule(mgr, &reqs, &options, streams, &mut hook));
    let outcome = run.map_err(|e| loop_err(py, e, waiting.take()))?;
    let out = PyDict::new(py);
    let counters = counters_dict(py, &outcome.counters)?;
    // The options `SimResult` reports beside the counters.
    counters.set_item("max_num_batched_tokens", options.budget)?;
    counters.set_item(
        "long_prefill_token_threshold",
        options.long_prefill_token_threshold,
    )?;
    out.set_item("counters", counters)?;
    out.set_item("series", series_dict(py, outcome.series)?)?;
    match outcome.log {
        Some(log) => {
            let list = PyList::empty(py);
            for l in log {
                list.append(logged(py, l.call, l.answer, &salts)?)?;
            }
            out.set_item("log", list)?;
        }
        None => out.set_item("log", py.None())?,
    }
    Ok(out)
}
