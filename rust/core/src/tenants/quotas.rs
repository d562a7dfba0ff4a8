//! Tenant quotas over any policy (`tenants=True`): caps and reserves of CACHED blocks.
//!
//! Tenants without a quota share one instance of the manager's policy (the shared group);
//! each tenant given a quota gets its own instance, so one tenant's scan cannot flood
//! another's history. An own instance keeps its per-block tables sparse
//! (`eviction::block_table`): it costs what the tenant holds, not the pool (before, each
//! took 64 to 72 MiB at 1 Mi blocks, and was never freed). The pool builds it before it
//! takes the policy's lock and hands it in (`set_quota`'s `spare`).
//!
//! When a tenant gets its first quota, its CACHED blocks move from the shared instance to
//! its own, in release order, with what their policy carries (`Policy::carry_out`: the
//! priority policy's retention, level, deadline and release time; other policies'
//! frequencies and queue places stay behind). Its held blocks (revived by a hit) stay members
//! of the shared instance, which knows their history, and move when they come back: at their
//! release, or at a failed call's restore, which may run after the quota call (the two take
//! the lock separately). A held block's retention for its next release waits in its group's
//! policy, as in a lone policy, so that resetting it when the block goes FREE leaves nothing
//! stale there; the retention of a block no group knows waits here (`pending`).
//!
//! A quota set back to none (`Quota::default()`: no cap, no reserve) dissolves the tenant's
//! group at once: its CACHED blocks move back to the shared instance in release order, with
//! what they carry; its held blocks become members of the shared instance too, with the
//! retention they had (their revival history is dropped with the instance: they come back
//! as new blocks, and a failed call's restore places them so). The instance goes back to the
//! pool, which frees it after the lock.
//!
//! The rules, exactly as the plain reference (`testing/pagedkv_reference/eviction/quotas.py`)
//! states them:
//!
//! 1. Cap. A tenant never has more than `max_cached` CACHED blocks after a call returns
//!    (pinned blocks, which no policy sees, excepted): a release, a restore or a lowered cap
//!    that puts it over evicts its own policy's victims at once (`trimmed`, freed by the
//!    pool).
//! 2. Reserve. `victim` chooses among the groups with more CACHED blocks than their reserve
//!    (the shared group's is 0); only when none has an evictable block, among all.
//! 3. Across groups, each allowed group's policy names its next victim (`peek`), and the
//!    least by (`cross_rank`, release order) goes: least recently released for every policy
//!    but priority, whose level and time come first. With one group this is the policy.

use super::Quota;
use crate::clock::Clock;
use crate::error::Result;
use crate::eviction::{
    new_locked_policy, new_tenant_policy, Carried, CrossRank, EvictionKind, Policy, Retention,
};
use crate::hashing::Digest;
use crate::id_hasher::BuildIdHasher;
use crate::lru_queue::Entry;
use std::collections::{HashMap, HashSet};
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
    /// Held when its group was dissolved: its group's policy (the shared one now) never saw
    /// its hit, so a failed call's restore places it as a new block.
    orphan: bool,
}

type BlockSet = HashSet<u32, BuildIdHasher>;

pub struct Quotas {
    kind: EvictionKind,
    num_blocks: usize,
    clock: Arc<Clock>,
    /// `groups[SHARED]`, then the own groups of the tenants with a quota; a dissolved
    /// group's slot is `None` until another tenant's first quota takes it.
    groups: Vec<Option<Group>>,
    /// Tenant -> its own group (tenants with a quota).
    own: HashMap<u32, usize, BuildIdHasher>,
    members: HashMap<u32, Member, BuildIdHasher>,
    /// Tenant -> its members (so a first quota or a dissolution finds a tenant's blocks
    /// without a scan of every member); a tenant without members has no entry.
    by_tenant: HashMap<u32, BlockSet, BuildIdHasher>,
    /// Retention set on blocks that are not members (held since before any release that
    /// cached them), given to their group's policy when they are cached. Never a member's.
    pending: HashMap<u32, Retention, BuildIdHasher>,
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
            groups: vec![Some(shared)],
            own: HashMap::default(),
            members: HashMap::default(),
            by_tenant: HashMap::default(),
            pending: HashMap::default(),
            next_seq: 0,
        })
    }

    /// A tenant's own instance (sparse), to build before taking the pool's lock.
    pub fn new_instance(
        kind: EvictionKind,
        num_blocks: usize,
        clock: &Arc<Clock>,
    ) -> Result<Box<dyn Policy>> {
        new_tenant_policy(kind, num_blocks, clock)
    }

    fn grp(&self, g: usize) -> &Group {
        self.groups[g].as_ref().expect("a live group")
    }

    fn grp_mut(&mut self, g: usize) -> &mut Group {
        self.groups[g].as_mut().expect("a live group")
    }

    fn group_of_tenant(&self, tenant: u32) -> usize {
        self.own.get(&tenant).copied().unwrap_or(SHARED)
    }

    /// Record `m` as `block`'s member, keeping `by_tenant` in step.
    fn put_member(&mut self, block: u32, m: Member) {
        if let Some(old) = self.members.insert(block, m) {
            if old.tenant == m.tenant {
                return;
            }
            self.unindex(old.tenant, block);
        }
        self.by_tenant.entry(m.tenant).or_default().insert(block);
    }

    fn drop_member(&mut self, block: u32) -> Option<Member> {
        let m = self.members.remove(&block)?;
        self.unindex(m.tenant, block);
        Some(m)
    }

    fn unindex(&mut self, tenant: u32, block: u32) {
        if let Some(set) = self.by_tenant.get_mut(&tenant) {
            set.remove(&block);
            if set.is_empty() {
                self.by_tenant.remove(&tenant);
            }
        }
    }

    /// `tenant`'s members matching `f`, in release order.
    fn members_of(&self, tenant: u32, f: impl Fn(&Member) -> bool) -> Vec<u32> {
        let Some(set) = self.by_tenant.get(&tenant) else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u32)> = set
            .iter()
            .map(|b| (b, &self.members[b]))
            .filter(|(_, m)| f(m))
            .map(|(&b, m)| (m.seq, b))
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, b)| b).collect()
    }

    /// Evict group `g`'s own victims until it is within its cap (rule 1).
    fn trim(&mut self, g: usize, trimmed: &mut Vec<Entry>) {
        let Some(cap) = self.grp(g).quota.max_cached else {
            return;
        };
        while self.grp(g).len > cap {
            let Some(e) = self.grp_mut(g).policy.victim() else {
                break;
            };
            self.drop_member(e.block);
            self.grp_mut(g).len -= 1;
            trimmed.push(e);
        }
    }

    /// Give `tenant` its own group (the instance in `spare`, else a new one), moving its
    /// CACHED blocks there in release order. Its held blocks (revived by a hit) stay members
    /// of the shared group, whose policy knows their history, until they come back
    /// (`rehome`).
    fn own_group(&mut self, tenant: u32, spare: &mut Option<Box<dyn Policy>>) -> Result<usize> {
        if let Some(&g) = self.own.get(&tenant) {
            return Ok(g);
        }
        let policy = match spare.take() {
            Some(p) => p,
            None => Self::new_instance(self.kind, self.num_blocks, &self.clock)?,
        };
        debug_assert_eq!(policy.len(), 0, "a tenant's instance starts empty");
        let group = Some(Group {
            policy,
            quota: Quota::default(),
            len: 0,
        });
        let g = match self.groups.iter().position(Option::is_none) {
            Some(g) => {
                self.groups[g] = group;
                g
            }
            None => {
                self.groups.push(group);
                self.groups.len() - 1
            }
        };
        self.own.insert(tenant, g);
        for block in self.members_of(tenant, |m| m.group == SHARED && m.in_set) {
            self.move_home(block);
        }
        Ok(g)
    }

    /// Dissolve `tenant`'s own group (its quota is gone): its CACHED blocks move to the
    /// shared group in release order with what they carry, its held blocks become the shared
    /// group's members with their retention (orphans: their history goes with the instance),
    /// and the instance is handed back in `spare`, to be freed after the lock.
    fn dissolve(&mut self, tenant: u32, spare: &mut Option<Box<dyn Policy>>) {
        let Some(g) = self.own.remove(&tenant) else {
            return;
        };
        for block in self.members_of(tenant, |m| m.group == g && m.in_set) {
            self.move_home(block);
        }
        for block in self.members_of(tenant, |m| m.group == g && !m.in_set) {
            let carried = self.grp_mut(g).policy.carry_out(block, false);
            let shared = &mut self.grp_mut(SHARED).policy;
            if carried.retention != Retention::DEFAULT {
                shared.set_retention(block, carried.retention);
            }
            let m = self.members[&block];
            self.put_member(
                block,
                Member {
                    group: SHARED,
                    orphan: true,
                    ..m
                },
            );
        }
        let group = self.groups[g].take().expect("a live group");
        debug_assert_eq!(group.len, 0, "every member moved");
        *spare = Some(group.policy);
    }

    /// Move the member `block`, in the set, from its group to its tenant's, with what its
    /// policy carries (the priority policy: retention and rank). Its release order across
    /// groups (`seq`) stays.
    fn move_home(&mut self, block: u32) {
        let m = self.members[&block];
        let home = self.group_of_tenant(m.tenant);
        if m.group == home {
            return;
        }
        debug_assert!(m.in_set, "block {block} moves while held");
        let carried = self.grp_mut(m.group).policy.carry_out(block, true);
        self.grp_mut(m.group).len -= 1;
        self.grp_mut(home).policy.carry_in(m.entry, carried);
        self.grp_mut(home).len += 1;
        self.put_member(block, Member { group: home, ..m });
    }

    /// A member just back in its group's set (a revival, a failed call's restore): if its
    /// tenant got its own group while it was held, it moves there now; then its group keeps
    /// its cap.
    fn rehome(&mut self, block: u32, trimmed: &mut Vec<Entry>) {
        self.move_home(block);
        let g = self.members[&block].group;
        self.trim(g, trimmed);
    }

    /// Groups alive (the shared one and the quota tenants'), for tests and audits.
    #[cfg(all(test, not(loom)))]
    fn live_groups(&self) -> usize {
        self.groups.iter().filter(|g| g.is_some()).count()
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
        let home = self.group_of_tenant(tenant);
        let seq = self.next_seq;
        self.next_seq += 1;
        let pending = self.pending.remove(&e.block);
        let member = |group| Member {
            group,
            tenant,
            entry: e,
            seq,
            in_set: true,
            orphan: false,
        };
        match self.members.get(&e.block).copied() {
            // A revival goes back to the group it left, whose policy knows its history (an
            // orphan's places it as new), and moves on from there if its tenant got its own
            // group meanwhile.
            Some(m) if !m.in_set && m.entry.digest == e.digest => {
                debug_assert!(pending.is_none(), "a member's retention is its group's");
                self.grp_mut(m.group).policy.cached(e);
                self.grp_mut(m.group).len += 1;
                self.put_member(e.block, member(m.group));
                self.rehome(e.block, trimmed);
                return;
            }
            // New content in a block held since its last release: the retention its holder
            // gave it waits in its old group's policy, and comes along.
            Some(m) if !m.in_set && m.group != home => {
                debug_assert!(pending.is_none(), "a member's retention is its group's");
                let held = self.grp_mut(m.group).policy.carry_out(e.block, false);
                let carried = Carried {
                    retention: held.retention,
                    rank: None,
                };
                self.grp_mut(home).policy.carry_in(e, carried);
            }
            _ => {
                if let Some(r) = pending {
                    self.grp_mut(home).policy.set_retention(e.block, r);
                }
                self.grp_mut(home).policy.cached(e);
            }
        }
        self.grp_mut(home).len += 1;
        self.put_member(e.block, member(home));
        self.trim(home, trimmed);
    }

    fn hit(&mut self, block: u32) {
        let m = self.members.get_mut(&block).expect("hit on a member");
        m.in_set = false;
        let g = m.group;
        let group = self.grp_mut(g);
        group.policy.hit(block);
        group.len -= 1;
    }

    fn restore(&mut self, e: Entry) {
        let mut trimmed = Vec::new();
        self.restore_by(e, &mut trimmed);
        assert!(
            trimmed.is_empty(),
            "a restore trimmed: the pool calls restore_by"
        );
    }

    fn restore_by(&mut self, e: Entry, trimmed: &mut Vec<Entry>) {
        let m = self.members.get_mut(&e.block).expect("restore of a member");
        m.in_set = true;
        m.entry = e;
        let (g, orphan) = (m.group, m.orphan);
        m.orphan = false;
        let group = self.grp_mut(g);
        if orphan {
            // Its hit was in a dissolved group's instance: placed as new here.
            group.policy.cached(e);
        } else {
            group.policy.restore(e);
        }
        group.len += 1;
        self.rehome(e.block, trimmed);
    }

    fn removed(&mut self, block: u32) {
        let m = self.drop_member(block).expect("removal of a member");
        let group = self.grp_mut(m.group);
        group.policy.removed(block);
        group.len -= 1;
    }

    fn miss(&mut self, digest: &Digest) {
        // Digests carry the salt: only the group that held this key reacts.
        self.groups
            .iter_mut()
            .flatten()
            .for_each(|g| g.policy.miss(digest));
    }

    fn victim(&mut self) -> Option<Entry> {
        // (below its reserve, level, time, release order): least goes (rules 2 and 3).
        let mut best: Option<(Rank, usize)> = None;
        for g in 0..self.groups.len() {
            let Some(group) = self.groups[g].as_mut() else {
                continue;
            };
            if group.len == 0 {
                continue;
            }
            let Some(e) = group.policy.peek() else {
                continue;
            };
            let rank = Rank {
                below_reserve: group.len <= group.quota.reserved,
                cross: group.policy.cross_rank(e.block),
                seq: self.members[&e.block].seq,
            };
            if best.as_ref().is_none_or(|(b, _)| rank.before(b)) {
                best = Some((rank, g));
            }
        }
        let (_, g) = best?;
        // Every other group peeked was passed over: its peek binds no later call (item 8 of
        // issue 32: a priority instance kept its peek's time, so its block whose duration ran
        // out since kept ranking at its raised level).
        for (i, other) in self.groups.iter_mut().enumerate() {
            match other {
                Some(other) if i != g && other.len > 0 => other.policy.passed_over(),
                _ => {}
            }
        }
        let e = self.grp_mut(g).policy.victim()?;
        self.drop_member(e.block);
        self.grp_mut(g).len -= 1;
        Some(e)
    }

    fn peek(&mut self) -> Option<Entry> {
        unimplemented!("quotas are not nested")
    }

    fn cross_rank(&self, _block: u32) -> CrossRank {
        unimplemented!("quotas are not nested")
    }

    fn len(&self) -> usize {
        self.groups.iter().flatten().map(|g| g.len).sum()
    }

    fn table_bytes(&self) -> usize {
        self.groups
            .iter()
            .flatten()
            .map(|g| g.policy.table_bytes())
            .sum()
    }

    fn entries(&self) -> Vec<Entry> {
        self.groups
            .iter()
            .flatten()
            .flat_map(|g| g.policy.entries())
            .collect()
    }

    fn clear(&mut self) -> Vec<Entry> {
        self.members.clear();
        self.by_tenant.clear();
        self.pending.clear();
        let mut out = Vec::new();
        for g in self.groups.iter_mut().flatten() {
            out.extend(g.policy.clear());
            g.len = 0;
        }
        out
    }

    fn set_retention(&mut self, block: u32, retention: Retention) {
        match self.members.get(&block) {
            // In the set: at once. Held since a hit: its group's policy keeps it for the
            // next release, as a lone policy does (a block that goes FREE is reset so, and
            // no stale retention stays behind there).
            Some(m) => {
                let g = m.group;
                self.grp_mut(g).policy.set_retention(block, retention);
            }
            None => {
                if retention == Retention::DEFAULT {
                    self.pending.remove(&block);
                } else {
                    self.pending.insert(block, retention);
                }
            }
        }
    }

    fn set_quota(
        &mut self,
        tenant: u32,
        quota: Quota,
        spare: &mut Option<Box<dyn Policy>>,
        trimmed: &mut Vec<Entry>,
    ) -> Result<()> {
        if quota == Quota::default() {
            self.dissolve(tenant, spare);
            return Ok(());
        }
        // Fails (nothing changed) only when no instance was handed in and a new one does
        // not fit.
        let g = self.own_group(tenant, spare)?;
        self.grp_mut(g).quota = quota;
        self.trim(g, trimmed);
        Ok(())
    }

    fn tenant_policy_bytes(&self, tenant: u32) -> Option<usize> {
        let g = *self.own.get(&tenant)?;
        Some(self.grp(g).policy.table_bytes())
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
            &mut None,
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
        q.set_quota(7, open(), &mut None, &mut trimmed).unwrap();
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

    /// A quota that caps nothing in these tests but gives the tenant its own group.
    fn open() -> Quota {
        cap(1 << 30)
    }

    fn cap(n: usize) -> Quota {
        Quota {
            max_cached: Some(n),
            reserved: 0,
        }
    }

    fn blocks(trimmed: &[Entry]) -> Vec<u32> {
        trimmed.iter().map(|e| e.block).collect()
    }

    #[test]
    fn a_restore_after_the_first_quota_moves_the_block_to_its_tenants_group() {
        // A failed call's hit and its restore take the lock separately: a first quota may
        // come between them. The held block stays a member of the shared group (it was
        // dropped before, and the restore panicked on the missing member) and moves at the
        // restore; the tenant's cap then holds.
        let d = sample_digests(6);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        for b in 0..4 {
            q.cached_by(entry(b, &d), 3, &mut trimmed);
        }
        q.hit(1);
        q.set_quota(3, cap(2), &mut None, &mut trimmed).unwrap();
        assert_eq!(
            blocks(&trimmed),
            vec![0],
            "the cap trims among the cached 0, 2, 3"
        );
        trimmed.clear();
        q.restore_by(entry(1, &d), &mut trimmed);
        // Back in its tenant's group, which is over its cap now: LRU carries no queue place,
        // so block 1 joined as its newest and the oldest there (2) goes.
        assert_eq!(blocks(&trimmed), vec![2]);
        assert_eq!(q.grp(SHARED).len, 0);
        assert_eq!(q.len(), 2);
        // The same with room under the cap: the restored block stays, in the tenant's group.
        q.set_quota(3, cap(3), &mut None, &mut trimmed).unwrap();
        q.hit(3);
        trimmed.clear();
        q.restore_by(entry(3, &d), &mut trimmed);
        assert!(trimmed.is_empty());
        assert_eq!(q.members[&3].group, q.own[&3]);
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_restore_trims_when_other_releases_filled_the_cap_meanwhile() {
        let d = sample_digests(6);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        q.set_quota(5, cap(2), &mut None, &mut trimmed).unwrap();
        q.cached_by(entry(0, &d), 5, &mut trimmed);
        q.cached_by(entry(1, &d), 5, &mut trimmed);
        q.hit(0);
        // Another thread's release of the same tenant, between the hit and the restore.
        q.cached_by(entry(2, &d), 5, &mut trimmed);
        assert!(trimmed.is_empty());
        q.restore_by(entry(0, &d), &mut trimmed);
        // Block 0 is back at its place (the oldest), so it is the one the cap evicts.
        assert_eq!(blocks(&trimmed), vec![0]);
        assert_eq!(q.grp(q.own[&5]).len, 2);
    }

    #[test]
    fn a_revival_after_the_first_quota_moves_the_block_too() {
        let d = sample_digests(6);
        let mut q = quotas();
        let mut trimmed = Vec::new();
        for b in 0..3 {
            q.cached_by(entry(b, &d), 4, &mut trimmed);
        }
        q.hit(0);
        q.set_quota(4, cap(2), &mut None, &mut trimmed).unwrap();
        assert!(trimmed.is_empty());
        // Its holder releases it, same content: revived in the shared group, then moved.
        q.cached_by(entry(0, &d), 4, &mut trimmed);
        assert_eq!(blocks(&trimmed), vec![1]);
        assert_eq!(q.grp(SHARED).len, 0);
        assert_eq!(q.members[&0].group, q.own[&4]);
    }

    fn keep(priority: u8, duration: Option<f64>) -> Retention {
        Retention { priority, duration }
    }

    /// Tenant 1: block 0 at 90 for 5 s, block 1 at 60 for good, block 2 at the default,
    /// released at 0, 1 and 2 s; tenant 2 (shared): block 3 at the default, at 3 s. Tenant 1
    /// gets its first quota at 4 s. Returns the eviction order at `at`.
    fn order_after_the_first_quota(at: f64, quota: bool) -> Vec<u32> {
        let clock = Arc::new(Clock::default());
        clock.set(0.0).unwrap();
        let d = sample_digests(8);
        let mut q = Quotas::new(EvictionKind::Priority, 16, &clock).unwrap();
        let mut trimmed = Vec::new();
        q.set_retention(0, keep(90, Some(5.0)));
        q.set_retention(1, keep(60, None));
        for (b, t) in [(0, 1), (1, 1), (2, 1), (3, 2)] {
            clock.set(f64::from(b)).unwrap();
            q.cached_by(entry(b, &d), t, &mut trimmed);
        }
        clock.set(4.0).unwrap();
        if quota {
            q.set_quota(1, open(), &mut None, &mut trimmed).unwrap();
            assert_eq!(q.grp(SHARED).len, 1);
        }
        assert!(trimmed.is_empty());
        clock.set(at).unwrap();
        std::iter::from_fn(|| q.victim().map(|e| e.block)).collect()
    }

    #[test]
    fn the_first_quota_carries_retention_and_rank() {
        // Before block 0's deadline: 2 and 3 at the default by release time, then 1 (60),
        // then 0 (90). After it, block 0 counts as released at 5 s at the default: after 2
        // and 3, before 1. Exactly the order without the quota: the levels, deadlines and
        // release times came along (before, the moved blocks lost their retention and
        // counted as released at 4 s).
        for quota in [false, true] {
            assert_eq!(order_after_the_first_quota(4.5, quota), vec![2, 3, 1, 0]);
            assert_eq!(order_after_the_first_quota(6.0, quota), vec![2, 3, 0, 1]);
        }
    }

    #[test]
    fn a_passed_over_peek_does_not_keep_an_expired_block_at_its_level() {
        // Issue 32, item 8: tenant 1 (own group) caches block 0 at 100 for 5 s at t=0; the
        // shared group caches block 1 at t=1. The victim at t=2 peeks block 0 and takes 1.
        // Blocks 2 and 3 are cached at t=6; at t=10 block 0's duration has run out (t=5):
        // it ranks as released at 5, before them. (Before, its group kept the t=2 peek's
        // time, ranking block 0 at 100.)
        let clock = Arc::new(Clock::default());
        clock.set(0.0).unwrap();
        let d = sample_digests(8);
        let mut q = Quotas::new(EvictionKind::Priority, 16, &clock).unwrap();
        let mut trimmed = Vec::new();
        q.set_quota(1, cap(4), &mut None, &mut trimmed).unwrap();
        q.set_retention(0, keep(100, Some(5.0)));
        q.cached_by(entry(0, &d), 1, &mut trimmed);
        clock.set(1.0).unwrap();
        q.cached_by(entry(1, &d), 2, &mut trimmed);
        clock.set(2.0).unwrap();
        assert_eq!(q.victim().map(|e| e.block), Some(1));
        clock.set(6.0).unwrap();
        q.cached_by(entry(2, &d), 2, &mut trimmed);
        q.cached_by(entry(3, &d), 2, &mut trimmed);
        clock.set(10.0).unwrap();
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![0, 2, 3]);
        assert!(trimmed.is_empty());
    }

    #[test]
    fn a_held_blocks_retention_goes_with_it_and_leaves_nothing_stale() {
        let clock = Arc::new(Clock::default());
        let d = sample_digests(8);
        let mut q = Quotas::new(EvictionKind::Priority, 16, &clock).unwrap();
        let mut trimmed = Vec::new();
        q.set_retention(0, keep(90, None));
        q.cached_by(entry(0, &d), 1, &mut trimmed);
        q.hit(0);
        // Its holder's content is withdrawn; it goes FREE: its retention is reset.
        q.set_retention(0, Retention::DEFAULT);
        // Reused by tenant 2 without retention, next to block 1 released before it: block 0
        // must be the newer default block, not a stale 90.
        q.cached_by(entry(1, &d), 2, &mut trimmed);
        let fresh = Entry {
            digest: d[5],
            ..entry(0, &d)
        };
        q.cached_by(fresh, 2, &mut trimmed);
        q.cached_by(entry(2, &d), 2, &mut trimmed);
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![1, 0, 2]);
        // Held across a first quota, given retention by its holder, released with new
        // content into another tenant's group: the retention comes along.
        q.set_retention(3, keep(80, None));
        q.cached_by(entry(3, &d), 1, &mut trimmed);
        q.hit(3);
        q.set_quota(1, open(), &mut None, &mut trimmed).unwrap();
        q.set_retention(3, keep(70, None));
        let other = Entry {
            digest: d[6],
            ..entry(3, &d)
        };
        q.cached_by(other, 2, &mut trimmed);
        q.cached_by(entry(4, &d), 1, &mut trimmed);
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![4, 3]);
        assert_eq!(q.groups.iter().flatten().map(|g| g.len).sum::<usize>(), 0);
    }

    #[test]
    fn an_own_instance_costs_what_its_tenant_holds_not_the_pool() {
        // Issue 32, item 9: at 1 Mi blocks each own instance took 64 to 72 MiB (tables of
        // every block), built under the lock and never freed.
        let clock = Arc::new(Clock::default());
        let n = 1 << 20;
        let d = sample_digests(64);
        for kind in EvictionKind::ALL {
            let mut q = Quotas::new(kind, n, &clock).unwrap();
            let mut trimmed = Vec::new();
            let mut spare = Some(Quotas::new_instance(kind, n, &clock).unwrap());
            q.set_quota(9, cap(1000), &mut spare, &mut trimmed).unwrap();
            assert!(spare.is_none(), "{kind:?}: the instance handed in is used");
            let empty = q.tenant_policy_bytes(9).unwrap();
            assert!(empty < 1024, "{kind:?}: {empty} bytes with nothing held");
            // 64 blocks spread over the pool's ids.
            let block = |i: usize| (i * (n / 64)) as u32;
            for (i, digest) in d.iter().enumerate() {
                let e = Entry {
                    block: block(i),
                    generation: 0,
                    digest: *digest,
                };
                q.cached_by(e, 9, &mut trimmed);
            }
            let full = q.tenant_policy_bytes(9).unwrap();
            assert!(full < 64 * 512, "{kind:?}: {full} bytes for 64 blocks");
            while q.victim().is_some() {}
            let after = q.tenant_policy_bytes(9).unwrap();
            assert!(after <= full, "{kind:?}: {after} > {full}");
            // No quota: the group goes, and its instance comes back to be freed.
            q.set_quota(9, Quota::default(), &mut spare, &mut trimmed)
                .unwrap();
            assert!(
                spare.is_some(),
                "{kind:?}: the dissolved instance is handed back"
            );
            assert_eq!(q.tenant_policy_bytes(9), None);
            assert_eq!(q.live_groups(), 1);
            assert!(trimmed.is_empty());
        }
    }

    #[test]
    fn a_removed_quota_moves_its_blocks_back_in_order_with_their_retention() {
        // Tenant 1: block 0 at 90, block 1 at the default, block 2 at 60 held (hit) when the
        // quota goes; tenant 2 (shared): block 3 at the default. Without the quota the order
        // is as if it never was: 1, 3 (defaults by release), then 0 (90); block 2 is an
        // orphan of the shared group now: its restore places it as new with its 60.
        let clock = Arc::new(Clock::default());
        clock.set(0.0).unwrap();
        let d = sample_digests(8);
        let mut q = Quotas::new(EvictionKind::Priority, 16, &clock).unwrap();
        let mut trimmed = Vec::new();
        q.set_quota(1, open(), &mut None, &mut trimmed).unwrap();
        q.set_retention(0, keep(90, None));
        q.set_retention(2, keep(60, None));
        for (b, t) in [(0, 1), (1, 1), (2, 1), (3, 2)] {
            clock.set(f64::from(b)).unwrap();
            q.cached_by(entry(b, &d), t, &mut trimmed);
        }
        q.hit(2);
        let mut spare = None;
        q.set_quota(1, Quota::default(), &mut spare, &mut trimmed)
            .unwrap();
        assert!(spare.is_some());
        assert_eq!((q.live_groups(), q.grp(SHARED).len), (1, 3));
        assert!(q.members[&2].orphan);
        clock.set(5.0).unwrap();
        q.restore_by(entry(2, &d), &mut trimmed);
        assert!(!q.members[&2].orphan);
        let order: Vec<u32> = std::iter::from_fn(|| q.victim().map(|e| e.block)).collect();
        assert_eq!(order, vec![1, 3, 2, 0]);
        // A quota again: a new group (the slot reused), and a removal of a tenant with no
        // quota changes nothing.
        q.set_quota(1, open(), &mut None, &mut trimmed).unwrap();
        assert_eq!(q.live_groups(), 2);
        q.set_quota(7, Quota::default(), &mut spare, &mut trimmed)
            .unwrap();
        assert_eq!(q.live_groups(), 2);
        assert!(q.by_tenant.is_empty() && q.members.is_empty());
    }
}
