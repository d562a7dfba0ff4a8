//! Moving a hybrid sequence between the GPU pool and the CPU swap space: every group's
//! non-null entries, group by group in table order; nulls stay nulls.

use super::manager::{GroupManager, State};
use super::pool::NULL;
use super::table::{GroupSeq, SWAPPED_NULL};
use crate::error::{Error, Result};
use crate::events::{KvEvent, Medium};

impl GroupManager {
    pub fn swap_out(&self, id: u64) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            if seq.cpu.is_some() {
                return Err(Error::Swapped(id));
            }
            let count = seq.tables.iter().flatten().filter(|&&b| b != NULL).count();
            if count > st.cpu_free.len() {
                return Ok(None);
            }
            let mut seq = st.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
            let mut pairs = Vec::with_capacity(count);
            let mut cpu = Vec::with_capacity(seq.tables.len());
            for table in &seq.tables {
                let mut row = Vec::with_capacity(table.len());
                for &b in table {
                    if b == NULL {
                        row.push(SWAPPED_NULL);
                    } else {
                        let c = st.cpu_free.pop().unwrap_or(SWAPPED_NULL);
                        pairs.push((b, c));
                        row.push(c);
                    }
                }
                cpu.push(row);
            }
            // Hashed blocks stay CACHED on the GPU (a later prompt may hit them).
            for table in &seq.tables {
                for &b in table.iter().rev().filter(|&&b| b != NULL) {
                    st.pool.release(b)?;
                }
            }
            st.t.swapped_out += count as u64;
            seq.tables = Vec::new();
            seq.cpu = Some(cpu);
            self.for_each_cpu_copy(&seq, |g, i| {
                st.pool
                    .push_event(|| self.stored_event(&seq, g, i, Medium::Cpu));
            });
            st.seqs.insert(id, seq);
            Ok(Some(pairs))
        })
    }

    pub fn swap_in(&self, id: u64) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            let Some(cpu) = &seq.cpu else {
                return Err(Error::NotSwapped(id));
            };
            let count = cpu.iter().flatten().filter(|&&c| c != SWAPPED_NULL).count();
            if count > st.pool.available() {
                return Ok(None);
            }
            let mut seq = st.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
            let cpu = seq.cpu.take().unwrap_or_default();
            let mut pairs = Vec::with_capacity(count);
            let mut tables = Vec::with_capacity(cpu.len());
            let mut out = Ok(());
            for (g, row) in cpu.iter().enumerate() {
                let mut table = Vec::with_capacity(row.len());
                for &c in row {
                    if c == SWAPPED_NULL {
                        table.push(NULL);
                        continue;
                    }
                    match st.pool.take(g as u8) {
                        Ok(b) => {
                            pairs.push((c, b));
                            table.push(b);
                        }
                        Err(e) => out = Err(e),
                    }
                }
                tables.push(table);
            }
            let back: Vec<u32> = cpu
                .iter()
                .flatten()
                .copied()
                .filter(|&c| c != SWAPPED_NULL)
                .collect();
            st.cpu_free.extend(back.iter().rev());
            seq.cpu = Some(cpu);
            self.cpu_copies_removed(st, &seq);
            seq.cpu = None;
            seq.tables = tables;
            let reg = self.register_range(st, &mut seq, 0);
            st.t.swapped_in += count as u64;
            st.seqs.insert(id, seq);
            out.and(reg).map(|()| Some(pairs))
        })
    }

    /// `(group, position)` of each full scheduled block a swapped sequence keeps a CPU copy of.
    fn for_each_cpu_copy(&self, seq: &GroupSeq, mut f: impl FnMut(usize, usize)) {
        let Some(cpu) = &seq.cpu else { return };
        let reg = seq.registrable(self.block_size());
        for (g, row) in cpu.iter().enumerate() {
            for (i, &c) in row.iter().enumerate().take(reg) {
                if c != SWAPPED_NULL {
                    f(g, i);
                }
            }
        }
    }

    /// Queue `BlockRemoved(CPU)` for the copies `swap_out` announced.
    pub(crate) fn cpu_copies_removed(&self, st: &mut State, seq: &GroupSeq) {
        self.for_each_cpu_copy(seq, |g, i| {
            st.pool.push_event(|| KvEvent::BlockRemoved {
                block_hash: seq.digests[i],
                medium: Medium::Cpu,
                group: g as u8,
            });
        });
    }
}
