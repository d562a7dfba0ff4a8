//! Core results as the Python objects of `pagedkv.events`, `pagedkv.stats` and
//! `pagedkv.alloc_status` (plain dataclasses and an enum, shared with the reference model).

use pagedkv_core::{AllocStatus, EventQueueStats, GroupStats, KvEvent, Stats};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyType};

static STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static STATS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static GROUP_STATS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static STATUS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static QUEUE_STATS: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Events converted one by one, handing the GIL to other threads every `GIL_HAND_OFF`: a
/// snapshot or a long queue takes about 10 us an event, and the engine's threads must not
/// wait for all of it.
pub fn events<'py>(py: Python<'py>, events: &[KvEvent]) -> PyResult<Vec<Bound<'py, PyAny>>> {
    events_from(py, events.iter().cloned(), events.len())
}

/// `events` of events made one at a time (a snapshot's, `EventSnapshot::iter`).
pub fn events_from<'py>(
    py: Python<'py>,
    events: impl Iterator<Item = KvEvent>,
    len: usize,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    const GIL_HAND_OFF: usize = 256;
    let mut out = Vec::with_capacity(len);
    for (i, e) in events.enumerate() {
        if i > 0 && i % GIL_HAND_OFF == 0 {
            py.detach(|| ());
        }
        out.push(event(py, &e)?);
    }
    Ok(out)
}

pub fn event<'py>(py: Python<'py>, e: &KvEvent) -> PyResult<Bound<'py, PyAny>> {
    match e {
        KvEvent::BlockStored {
            block_hash,
            parent_block_hash,
            token_ids,
            lora_id,
            medium,
            group,
        } => {
            let kw = PyDict::new(py);
            kw.set_item(
                "block_hashes",
                vec![PyBytes::new(py, block_hash.as_bytes())],
            )?;
            kw.set_item(
                "parent_block_hash",
                parent_block_hash.map(|p| PyBytes::new(py, p.as_bytes())),
            )?;
            kw.set_item("token_ids", &token_ids[..])?;
            kw.set_item("block_size", token_ids.len())?;
            kw.set_item("lora_id", *lora_id)?;
            kw.set_item("medium", medium.name())?;
            kw.set_item("group_idx", *group)?;
            STORED
                .import(py, "pagedkv.events", "BlockStored")?
                .call((), Some(&kw))
        }
        KvEvent::BlockRemoved {
            block_hash,
            medium,
            group,
        } => {
            let kw = PyDict::new(py);
            kw.set_item(
                "block_hashes",
                vec![PyBytes::new(py, block_hash.as_bytes())],
            )?;
            kw.set_item("medium", medium.name())?;
            kw.set_item("group_idx", *group)?;
            REMOVED
                .import(py, "pagedkv.events", "BlockRemoved")?
                .call((), Some(&kw))
        }
        KvEvent::AllBlocksCleared => CLEARED
            .import(py, "pagedkv.events", "AllBlocksCleared")?
            .call0(),
    }
}

pub fn event_queue_stats<'py>(py: Python<'py>, s: &EventQueueStats) -> PyResult<Bound<'py, PyAny>> {
    let kw = PyDict::new(py);
    kw.set_item("queued", s.queued)?;
    kw.set_item("capacity", s.capacity)?;
    kw.set_item("dropped", s.dropped)?;
    kw.set_item("overflows", s.overflows)?;
    kw.set_item("blocks", s.blocks)?;
    QUEUE_STATS
        .import(py, "pagedkv.events", "KVEventQueueStats")?
        .call((), Some(&kw))
}

pub fn stats<'py>(
    py: Python<'py>,
    s: &Stats,
    groups: &[GroupStats],
) -> PyResult<Bound<'py, PyAny>> {
    let kw = PyDict::new(py);
    kw.set_item("num_blocks", s.num_blocks)?;
    kw.set_item("block_size", s.block_size)?;
    kw.set_item("free_blocks", s.free_blocks)?;
    kw.set_item("used_blocks", s.used_blocks)?;
    kw.set_item("cached_blocks", s.cached_blocks)?;
    kw.set_item("num_cpu_blocks", s.num_cpu_blocks)?;
    kw.set_item("free_cpu_blocks", s.free_cpu_blocks)?;
    kw.set_item("num_sequences", s.num_sequences)?;
    kw.set_item("prefix_queries", s.prefix_queries)?;
    kw.set_item("prefix_hits", s.prefix_hits)?;
    kw.set_item("evictions", s.evictions)?;
    kw.set_item("cow_copies", s.cow_copies)?;
    kw.set_item("swapped_out_blocks", s.swapped_out_blocks)?;
    kw.set_item("swapped_in_blocks", s.swapped_in_blocks)?;
    kw.set_item("reserved_slots", s.reserved_slots)?;
    kw.set_item("used_slots", s.used_slots)?;
    kw.set_item("recent_prefix_queries", s.recent_prefix_queries)?;
    kw.set_item("recent_prefix_hits", s.recent_prefix_hits)?;
    kw.set_item("registered_blocks", s.registered_blocks)?;
    kw.set_item("unregistered_blocks", s.unregistered_blocks)?;
    kw.set_item("truncated_blocks", s.truncated_blocks)?;
    // With a group that is not full attention block 0 is the null block: usage is over the
    // other blocks.
    let null = groups.iter().any(|g| g.kind != "full");
    let usable = s.num_blocks.saturating_sub(usize::from(null)).max(1) as f64;
    let cls = GROUP_STATS.import(py, "pagedkv.stats", "GroupStats")?;
    let per_group = groups
        .iter()
        .map(|g| {
            let kw = PyDict::new(py);
            kw.set_item("kind", g.kind)?;
            kw.set_item("used_blocks", g.used_blocks)?;
            kw.set_item("cached_blocks", g.cached_blocks)?;
            kw.set_item("usage", g.used_blocks as f64 / usable)?;
            kw.set_item("hit_blocks", g.hit_blocks)?;
            kw.set_item("evictions", g.evictions)?;
            kw.set_item("registered_blocks", g.registered_blocks)?;
            cls.call((), Some(&kw))
        })
        .collect::<PyResult<Vec<_>>>()?;
    kw.set_item("groups", pyo3::types::PyTuple::new(py, per_group)?)?;
    STATS
        .import(py, "pagedkv.stats", "Stats")?
        .call((), Some(&kw))
}

/// The `AllocStatus` members, looked up once: building an enum member per call costs
/// more than the whole admission check.
static STATUS_MEMBERS: PyOnceLock<[Py<PyAny>; 3]> = PyOnceLock::new();

pub fn alloc_status(py: Python<'_>, s: AllocStatus) -> PyResult<Bound<'_, PyAny>> {
    let members = STATUS_MEMBERS.get_or_try_init(py, || -> PyResult<[Py<PyAny>; 3]> {
        let cls = STATUS.import(py, "pagedkv.alloc_status", "AllocStatus")?;
        Ok([
            cls.getattr("OK")?.unbind(),
            cls.getattr("LATER")?.unbind(),
            cls.getattr("NEVER")?.unbind(),
        ])
    })?;
    let i = match s {
        AllocStatus::Ok => 0,
        AllocStatus::Later => 1,
        AllocStatus::Never => 2,
    };
    Ok(members[i].bind(py).clone())
}
