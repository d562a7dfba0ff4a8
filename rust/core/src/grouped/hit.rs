//! The hybrid prefix hit of a prompt (read-only looks at the lock-free index, per group and
//! position, then pins) and a new prompt's tables.

use crate::block_pool::{refcount_overflow, Hit};
use crate::counters;
use crate::error::Result;
use crate::hashing::{Digest, Tag};
use crate::manager::{cdiv, BlockManager};
use crate::policy::{hybrid_hit, Resume};

use super::NULL;

impl BlockManager {
    /// Whether group `g` has block `i` of the chain cached (a read-only look).
    pub(crate) fn present(&self, g: usize, digests: &[Digest], tags: &[Tag], i: usize) -> bool {
        let key = digests[i].keyed(g as u8);
        self.gpu
            .peek(&key)
            .is_some_and(|p| self.gpu.index_tag_is(p.block, tags.get(i).copied()))
    }

    /// The hybrid hit of a chain in blocks (at most `cap`) for a sequence resuming at
    /// `resume`, from read-only looks; `absent` entries count as missing (pins that lost a
    /// race).
    pub(crate) fn hybrid_hit_of(
        &self,
        digests: &[Digest],
        tags: &[Tag],
        cap: usize,
        resume: Resume,
        absent: &[(usize, usize)],
    ) -> usize {
        if !self.config.enable_prefix_caching {
            return 0;
        }
        let cap = cap.min(digests.len());
        hybrid_hit(&self.kinds, self.block_size(), cap, resume, |g, i| {
            !absent.contains(&(g, i)) && self.present(g, digests, tags, i)
        })
    }

    /// First entry group `g` needs when a sequence's next position is `p`.
    pub(crate) fn first_needed(&self, g: usize, p: usize) -> usize {
        self.kinds[g].first_needed(p, self.block_size())
    }

    /// First entry group `g` needs of a hit of `h` blocks resuming at `resume` (at most `h`).
    pub(crate) fn first_needed_of_hit(&self, g: usize, h: usize, resume: Resume) -> usize {
        resume.first_needed(self.kinds[g], h, self.block_size())
    }

    /// The blocks of a new prompt with a hybrid hit: per group, nulls below what it needs,
    /// the pinned hits, then `total(h)` new entries (the nulls are those of a sequence
    /// resuming at `resume`). Returns the tables and `h`, or `None` when they do not fit;
    /// then, and on an error, nothing is held.
    pub(crate) fn take_grouped_prompt(
        &self,
        total: &dyn Fn(usize) -> usize,
        cap: usize,
        resume: Resume,
        digests: &[Digest],
        tags: &[Tag],
    ) -> Result<Option<(Vec<Vec<u32>>, usize)>> {
        let groups = self.num_groups();
        let mut absent: Vec<(usize, usize)> = Vec::new();
        loop {
            let h = self.hybrid_hit_of(digests, tags, cap, resume, &absent);
            let t = total(h);
            // Every group holds `t` entries less its nulls: beyond the pool nothing fits
            // (`t` has no bound but the lookahead's, so the sum saturates).
            let held = (0..groups)
                .map(|g| t - self.first_needed_of_hit(g, h, resume))
                .fold(0usize, usize::saturating_add);
            if held > self.gpu.num_usable() {
                return Ok(None);
            }
            let mut wanted = Vec::new();
            let mut revivals = 0;
            for g in 0..groups {
                let lo = self.first_needed_of_hit(g, h, resume);
                for (i, d) in digests.iter().enumerate().take(h).skip(lo) {
                    match self.gpu.peek(&d.keyed(g as u8)) {
                        Some(p) if p.full => return Err(refcount_overflow(p.block)),
                        Some(p) => revivals += usize::from(p.cached),
                        None => {}
                    }
                    wanted.push((g, i));
                }
            }
            let new = groups * (t - h);
            let need = new + revivals;
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pinned: Vec<(usize, usize, u32, bool)> = Vec::with_capacity(wanted.len());
            let mut failure = None;
            let mut lost = None;
            for &(g, i) in &wanted {
                let key = digests[i].keyed(g as u8);
                match self.gpu.pin(&key, tags.get(i).copied(), &mut spare) {
                    Ok(Hit::Pinned { block, revived }) => pinned.push((g, i, block, revived)),
                    Ok(Hit::Miss | Hit::NoRoom) => {
                        lost = Some((g, i));
                        break;
                    }
                    Ok(Hit::Full(b)) => {
                        failure = Some(refcount_overflow(b));
                        break;
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            // Races may have revived what the looks saw owned: settle the units.
            let short = new.saturating_sub(spare);
            if failure.is_some() || lost.is_some() || (short > 0 && !self.gpu.reserve(short)) {
                for &(g, i, b, revived) in pinned.iter().rev() {
                    let key = digests[i].keyed(g as u8);
                    if revived {
                        self.gpu.unpin(b, &key)?;
                    } else {
                        self.gpu.release(b, Some(&key))?;
                    }
                }
                self.gpu.unreserve(spare);
                if let Some(e) = failure {
                    return Err(e);
                }
                match lost {
                    // Try again without the entry that lost its race.
                    Some(entry) => {
                        absent.push(entry);
                        continue;
                    }
                    None => return Ok(None),
                }
            }
            spare += short;
            let mut tables: Vec<Vec<u32>> = (0..groups)
                .map(|g| {
                    crate::alloc::try_with_capacity(t, "a block table").map(|mut v: Vec<u32>| {
                        v.resize(self.first_needed_of_hit(g, h, resume), NULL);
                        v
                    })
                })
                .collect::<Result<_>>()?;
            for &(g, _, b, _) in &pinned {
                tables[g].push(b);
                if let Some(tally) = self.gpu.tally(g as u8) {
                    counters::add(&tally.hit_blocks, 1);
                }
            }
            for (g, table) in tables.iter_mut().enumerate() {
                for _ in h..t {
                    table.push(self.take_for(g, &mut spare)?);
                }
            }
            self.gpu.unreserve(spare);
            return Ok(Some((tables, h)));
        }
    }

    /// The hybrid hit of a prompt of `n` tokens with these digests in blocks (at most `cap`),
    /// resuming at `resume`, under its prefix lock (read-only looks), and with `k` scheduled
    /// prompt tokens its admission (`can_allocate`).
    pub(crate) fn grouped_prefix(
        &self,
        n: usize,
        digests: &[Digest],
        tags: &[Tag],
        (cap, resume): (usize, Resume),
        k: Option<usize>,
    ) -> Result<(usize, Option<crate::stats::AllocStatus>)> {
        let bs = self.block_size();
        // Inside the gate: a reset is all before or all after.
        let _gate = self.enter()?;
        let _prefix = self.lock_prefixes(crate::manager::chain_lock(digests))?;
        let h = self.hybrid_hit_of(digests, tags, cap, resume, &[]);
        let Some(k) = k else { return Ok((h, None)) };
        let groups = self.num_groups();
        let len = cdiv((h * bs + k).min(n), bs);
        let (mut held, mut cached) = (0, 0);
        for g in 0..groups {
            let lo = self.first_needed_of_hit(g, h, resume);
            for d in digests.iter().take(h).skip(lo) {
                held += 1;
                let p = self.gpu.peek(&d.keyed(g as u8));
                cached += usize::from(p.is_some_and(|p| p.cached));
            }
        }
        let new = (len - h) * groups;
        Ok((h, Some(self.admission_of(new + held, new + cached))))
    }
}
