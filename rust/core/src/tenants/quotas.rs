//! Tenant quotas over any policy (`tenants=True`): caps and reserves of CACHED blocks.
//!
//! Tenants without a quota share one instance of the manager's policy (the shared group);
//! each tenant given a quota gets its own instance, so one tenant's scan cannot flood
//! another's history, and the per-instance tables stay few. When a tenant gets its first
//! quota, its CACHED blocks move from the shared instance to its own, in release order (their
//! frequencies and queue places there are not carried over). The rules, exactly as the plain
//! reference (`testing/pagedkv_reference/eviction/quotas.py`) states them:
//!
//! 1. Cap. A tenant never has more than `max_cached` CACHED blocks after a call returns
//!    (pinned blocks, which no policy sees, excepted): a release or a lowered cap that puts
//!    it over evicts its own policy's victims at once (`trimmed`, freed by the pool).
//! 2. Reserve. `victim` chooses among the groups with more CACHED blocks than their reserve
//!    (the shared group's is 0); only when none has an evictable block, among all.
//! 3. Across groups, each allowed group's policy names its next victim (`peek`), and the
//!    least by (`cross_rank`, release order) goes: least recently released for every policy
//!    but priority, whose level and time come first. With one group this is the policy.

use super::Quota;
use crate::clock::Clock;
use crate::error::Result;
use crate::eviction::{new_locked_policy, CrossRank, EvictionKind, Policy, Retention};
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use std::collections::HashMap;
use std::sync::Arc;

/// The shared group's index in `groups`.
const SHARED: usize = 0;

/// A group's candidate, as `victim` orders them: groups above their reserve first (rule
/// 2), then by the policy's cross rank and the release order (rule 3).
struct Rank {
    below_reserve: bool,
    cross: CrossRank,
    seq: u64,
}

impl Rank {
    fn before(&self, other: &Rank) -> bool {
        let (l, t, k) = self.cross;
        let (ol, ot, ok) = other.cross;
        (self.below_reserve, l)
            .cmp(&(other.below_reserve, ol))
            .then(t.total_cmp(&ot))
            .then(k.cmp(&ok))
            .then(self.seq.cmp(&other.seq))
            .is_lt()
    }
}

struct Group {
    policy: Box<dyn Policy>,
    quota: Quota,
    /// Its blocks in the set (CACHED and evictable).
    len: usize,
}

/// A block the wrapper knows: in the set, or taken out by a hit (kept for `restore` and for
/// its revival, which its group's policy recognises).
#[derive(Clone, Copy)]
struct Member {
    group: usize,
    tenant: u32,
    entry: Entry,
    /// Release order across every group (rule 3's tie-break).
    seq: u64,
    in_set: bool,
}

pub struct Quotas {
    kind: EvictionKind,
    num_blocks: usize,
    clock: Arc<Clock>,
    /// `groups[SHARED]`, then one per tenant with a quota, in the order they got one.
    groups: Vec<Group>,
    /// Tenant -> its own group (tenants with a quota).
    own: HashMap<u32, usize>,
    members: HashMap<u32, Member>,
    /// Retention set on held blocks, given to their group's policy when they are cached.
    pending: HashMap<u32, Retention>,
    next_seq: u64,
}

impl Quotas {
    pub fn new(kind: EvictionKind, num_blocks: usize, clock: &Arc<Clock>) -> Result<Self> {
        let shared = Group {
            policy: new_locked_policy(kind, num_blocks, clock)?,
            quota: Quota::default(),
            len: 0,
        };
        Ok(Self {
            kind,
            num_blocks,
            clock: clock.clone(),
            groups: vec![shared],
            own: HashMap::new(),
            members: HashMap::new(),
            pending: HashMap::new(),
            next_seq: 0,
        })
    }

    fn group_of_tenant(&self, tenant: u32) -> usize {
        self.own.get(&tenant).copied().unwrap_or(SHARED)
    }

    /// Evict group `g`'s own victims until it is within its cap (rule 1).
    fn trim(&mut self, g: usize, trimmed: &mut Vec<Entry>) {
        let Some(cap) = self.groups[g].quota.max_cached else {
            return;
        };
        while self.groups[g].len > cap {
            let Some(e) = self.groups[g].policy.victim() else {
                break;
            };
            self.members.remove(&e.block);
            self.groups[g].len -= 1;
            trimmed.push(e);
        }
    }

    /// Give `tenant` its own group, moving its CACHED blocks there in release order.
    fn own_group(&mut self, tenant: u32) -> Result<usize> {
        if let Some(&g) = self.own.get(&tenant) {
            return Ok(g);
        }
        let g = self.groups.len();
        self.groups.push(Group {
            policy: new_locked_policy(self.kind, self.num_blocks, &self.clock)?,
            quota: Quota::default(),
            len: 0,
        });
        self.own.insert(tenant, g);
        let mut moving: Vec<Member> = self
            .members
            .values()
            .filter(|m| m.tenant == tenant && m.group == SHARED)
            .copied()
            .collect();
        moving.sort_by_key(|m| m.seq);
        for m in moving {
            let mut moved = m;
            moved.group = g;
            if m.in_set {
                self.groups[SHARED].policy.removed(m.entry.block);
                self.groups[SHARED].len -= 1;
                self.groups[g].policy.cached(m.entry);
                self.groups[g].len += 1;
                self.members.insert(m.entry.block, moved);
            } else {
                // Revived and held: it joins its new group at its next release, as new.
                self.members.remove(&m.entry.block);
            }
        }
        Ok(g)
    }
}

impl Policy for Quotas {
    fn cached(&mut self, e: Entry) {
        let mut trimmed = Vec::new();
        self.cached_by(e, super::UNSALTED, &mut trimmed);
        debug_assert!(
            trimmed.is_empty(),
            "the unsalted tenant cached without trims"
        );
    }

    fn cached_by(&mut self, e: Entry, tenant: u32, trimmed: &mut Vec<Entry>) {
        // A revival goes back to the group it left (whose policy knows its history); any
        // other block to its tenant's group.
        let g = match self.members.get(&e.block) {
            Some(m) if !m.in_set && m.entry.digest == e.digest => m.group,
            _ => self.group_of_tenant(tenant),
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        if let Some(r) = self.pending.remove(&e.block) {
            self.groups[g].policy.set_retention(e.block, r);
        }
        self.groups[g].policy.cached(e);
        self.groups[g].len += 1;
        self.members.insert(
            e.block,
            Member {
                group: g,
                tenant,
                entry: e,
                seq,
                in_set: true,
            },
        );
        self.trim(g, trimmed);
    }

    fn hit(&mut self, block: u32) {
        let m = self.members.get_mut(&block).expect("hit on a member");
        m.in_set = false;
        let g = m.group;
        self.groups[g].policy.hit(block);
        self.groups[g].len -= 1;
    }

    fn restore(&mut self, e: Entry) {
        let m = self.members.get_mut(&e.block).expect("restore of a member");
        m.in_set = true;
        m.entry = e;
        let g = m.group;
        self.groups[g].policy.restore(e);
        self.groups[g].len += 1;
    }

    fn removed(&mut self, block: u32) {
        let m = self.members.remove(&block).expect("removal of a member");
        self.groups[m.group].policy.removed(block);
        self.groups[m.group].len -= 1;
    }

    fn miss(&mut self, digest: &Digest) {
        // Digests carry the salt: only the group that held this key reacts.
        self.groups.iter_mut().for_each(|g| g.policy.miss(digest));
    }

    fn victim(&mut self) -> Option<Entry> {
        // (below its reserve, level, time, release order): least goes (rules 2 and 3).
        let mut best: Option<(Rank, usize)> = None;
        for g in 0..self.groups.len() {
            if self.groups[g].len == 0 {
                continue;
            }
            let Some(e) = self.groups[g].policy.peek() else {
                continue;
            };
            let rank = Rank {
                below_reserve: self.groups[g].len <= self.groups[g].quota.reserved,
                cross: self.groups[g].policy.cross_rank(e.block),
                seq: self.members[&e.block].seq,
            };
            if best.as_ref().is_none_or(|(b, _)| rank.before(b)) {
                best = Some((rank, g));
            }
        }
        let (_, g) = best?;
        let e = self.groups[g].policy.victim()?;
        self.members.remove(&e.block);
        self.groups[g].len -= 1;
        Some(e)
    }

    fn peek(&mut self) -> Option<Entry> {
        unimplemented!("quotas are not nested")
    }

    fn cross_rank(&self, _block: u32) -> CrossRank {
        unimplemented!("quotas are not nested")
    }

    fn len(&self) -> usize {
        self.groups.iter().map(|g| g.len).sum()
    }

    fn entries(&self) -> Vec<Entry> {
        self.groups
            .iter()
            .flat_map(|g| g.policy.entries())
            .collect()
    }

    fn clear(&mut self) -> Vec<Entry> {
        self.members.clear();
        self.pending.clear();
        let mut out = Vec::new();
        for g in &mut self.groups {
            out.extend(g.policy.clear());
            g.len = 0;
        }
        out
    }

    fn set_retention(&mut self, block: u32, retention: Retention) {
        match self.members.get(&block) {
            Some(m) if m.in_set => self.groups[m.group].policy.set_retention(block, retention),
            _ => {
                if retention == Retention::DEFAULT {
                    self.pending.remove(&block);
                } else {
                    self.pending.insert(block, retention);
                }
            }
        }
    }

    fn set_quota(&mut self, tenant: u32, quota: Quota, trimmed: &mut Vec<Entry>) -> Result<()> {
        // Fails (nothing changed) when another policy's tables do not fit.
        let g = self.own_group(tenant)?;
        self.groups[g].quota = quota;
        self.trim(g, trimmed);
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::sample_digests;

    fn entry(block: u32, d: &[Digest]) -> Entry {
        Entry {
            block,
            generation: 0,
            digest: d[block as usize],
        }
    }

    fn quotas() -> Quotas {
        Quotas::new(EvictionKind::Lru, 16, &Arc::new(Clock::default())).unwrap()
    }

    #[test]
    fn without_quotas_it_is_one_lru() {
        let d = sample_digests(8);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        for b in 0..6 {
            q.cached_by(entry(b, &d), b % 3, &mut trimmed);
        }
        q.hit(1);
        q.cached_by(entry(1, &d), 1, &mut trimmed);
        assert!(trimmed.is_empty());
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![0, 2, 3, 4, 5, 1]);
    }

    #[test]
    fn a_cap_trims_its_own_oldest_and_a_reserve_goes_last() {
        let d = sample_digests(8);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        // Tenant 2's blocks 2, 3, 4 (oldest), then tenant 1's 0, 1.
        for (b, t) in [(2, 2), (3, 2), (4, 2), (0, 1), (1, 1)] {
            q.cached_by(entry(b, &d), t, &mut trimmed);
        }
        // Tenant 2's first quota: its blocks move to its own group, the cap trims its oldest.
        q.set_quota(
            2,
            Quota {
                max_cached: Some(2),
                reserved: 2,
            },
            &mut trimmed,
        )
        .unwrap();
        assert_eq!(trimmed.iter().map(|e| e.block).collect::<Vec<_>>(), vec![2]);
        assert_eq!(q.len(), 4);
        // A release over the cap trims again, at once.
        trimmed.clear();
        q.cached_by(entry(5, &d), 2, &mut trimmed);
        assert_eq!(trimmed.iter().map(|e| e.block).collect::<Vec<_>>(), vec![3]);
        // Tenant 2 is at its reserve: the shared group (tenant 1) gives the victims first,
        // though tenant 2's blocks are older.
        assert_eq!(q.victim().map(|e| e.block), Some(0));
        assert_eq!(q.victim().map(|e| e.block), Some(1));
        // Only reserved blocks are left: they go too, oldest first.
        assert_eq!(q.victim().map(|e| e.block), Some(4));
        assert_eq!(q.victim().map(|e| e.block), Some(5));
        assert!(q.victim().is_none());
    }

    #[test]
    fn a_failed_hit_is_restored_in_its_group() {
        let d = sample_digests(4);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        q.set_quota(7, Quota::default(), &mut trimmed).unwrap();
        for b in 0..3 {
            q.cached_by(entry(b, &d), 7, &mut trimmed);
        }
        q.hit(0);
        q.restore(entry(0, &d));
        q.removed(1);
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![0, 2]);
        assert_eq!(q.len(), 0);
    }
}
