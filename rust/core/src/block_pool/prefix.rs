//! The prefix cache's changes: hits (`peek`, `pin`), registration, and the withdrawal of
//! a hashed block (`retract`, `withdraw`), each under its digest's stripe.

use super::groups::{down, up};
use super::{stripe_of, BlockPool, Hit, Peek, Withdrawal};
use crate::block_state::{Pin, RC_MAX};
use crate::error::Result;
use crate::events::{KvEvent, Medium};
use crate::eviction::Retention;
use crate::hashing::{Digest, Tag};
use crate::sync::{lock, Ordering};

impl BlockPool {
    /// Without changing anything: is `digest` cached, and is its block CACHED (rc 0)?
    pub fn peek(&self, digest: &Digest) -> Option<Peek> {
        let b = self.index.get(digest)?;
        let w = self.state(b).load();
        w.hashed().then_some(Peek {
            block: b,
            cached: w.rc() == 0 && !w.pinned(),
            full: w.rc() == RC_MAX,
        })
    }

    /// Take a reference to the block cached under `digest` (and `tag`, for a tagged pool).
    /// Reviving a CACHED block costs one unit: from `spare` if the caller reserved some, else
    /// reserved here.
    pub fn pin(&self, digest: &Digest, tag: Option<Tag>, spare: &mut usize) -> Result<Hit> {
        let Some(b) = self.index.get(digest) else {
            return Ok(Hit::Miss);
        };
        let state = self.state(b);
        let mut have_unit = false;
        // Locked mode: taken before any attempt that may revive (one with a unit), so the
        // revival and the policy's `hit` are one step under its lock (`eviction_order`).
        // Without a unit `state.pin` never revives, so the first attempt needs no lock.
        let mut policy = None;
        loop {
            if have_unit && policy.is_none() {
                policy = self.order.guard();
            }
            match state.pin(have_unit) {
                Pin::Pinned { revived, unit } => {
                    // A pinned block is outside the policy (see `release_table`).
                    if let (true, Some(policy)) = (unit, policy.as_mut()) {
                        policy.hit(b);
                    }
                    if revived {
                        // Under the policy's lock when it took a unit, in the order of the
                        // releases and trims that count this tenant (`cache_by_tenants`).
                        self.count_cached(b, false);
                    }
                    drop(policy.take());
                    if revived {
                        self.cached.fetch_sub(1, Ordering::Relaxed);
                        if !unit {
                            // Relaxed: a tally (see the field).
                            self.pinned.fetch_sub(1, Ordering::Relaxed);
                        }
                        if let Some(t) = self.tally_of(b) {
                            down(&t.cached);
                            up(&t.used);
                        }
                    }
                    if have_unit && !unit {
                        *spare += 1;
                    }
                    // The lookup compared the digest racily; pinned and hashed, the block's
                    // digest is stable now, so this check is exact. It fails when the block
                    // was evicted and registered again under other content since the lookup,
                    // or (tagged pool) when another prefix collided on the public digest.
                    if !self.index.holds(b, digest) || !self.index.tag_is(b, tag) {
                        let own = self.index.stored(b, digest.as_bytes().len());
                        if revived {
                            self.unpin(b, &own)?;
                            // The unit goes back to `available`; the caller's stays spare.
                        } else {
                            self.release(b, Some(&own))?;
                        }
                        return Ok(Hit::Miss);
                    }
                    return Ok(Hit::Pinned { block: b, revived });
                }
                Pin::Stale => {
                    if have_unit {
                        *spare += 1;
                    }
                    return Ok(Hit::Miss);
                }
                Pin::Full => {
                    if have_unit {
                        *spare += 1;
                    }
                    return Ok(Hit::Full(b));
                }
                Pin::NeedsUnit if *spare > 0 => {
                    *spare -= 1;
                    have_unit = true;
                }
                Pin::NeedsUnit if self.reserve(1) => have_unit = true,
                Pin::NeedsUnit => return Ok(Hit::NoRoom),
            }
        }
    }

    /// Make an OWNED, full, unhashed block findable under `digest`, unless another block
    /// already holds that content (then it stays unhashed and is freed, not cached, when
    /// released). Atomic per digest (its stripe), so one digest is registered once.
    pub fn register(
        &self,
        block: u32,
        digest: Digest,
        tag: Option<Tag>,
        event: impl FnOnce() -> KvEvent,
    ) -> bool {
        let _stripe = lock(&self.stripes[stripe_of(&digest)]);
        // Under the stripe every entry of this digest names a hashed block: claims remove
        // the entry under the same stripe.
        if self.index.contains(&digest) {
            return false;
        }
        let state = self.state(block);
        self.index.write_digest(block, &digest, tag);
        state.set_hashed();
        if self.index.insert(&digest, block) {
            if let Some(log) = &self.events {
                log.push(event());
            }
            true
        } else {
            state.clear_hashed();
            false
        }
    }

    /// Withdraw `block` (hashed under `digest`, held by the caller) from the prefix cache:
    /// it stays OWNED by its holders but unhashed, its index entry goes and `BlockRemoved`
    /// is queued. `sole`: only if the caller is its only holder (else it stays cached).
    /// Under the digest's stripe, so it is ordered with every registration and claim of the
    /// digest. Returns whether it was withdrawn.
    pub fn retract(&self, block: u32, digest: &Digest, sole: bool) -> bool {
        let _stripe = lock(&self.stripes[stripe_of(digest)]);
        if !self.index.holds(block, digest) {
            return false;
        }
        let state = self.state(block);
        let withdrawn = if sole {
            state.unhash_if_sole()
        } else {
            state.unhash_held()
        };
        if !withdrawn {
            return false;
        }
        self.index.remove(digest, block);
        if let Some(log) = &self.events {
            let group = self.group_of(block);
            log.push(KvEvent::BlockRemoved {
                block_hash: digest.keyed(group),
                medium: Medium::Gpu,
                group,
            });
        }
        true
    }

    /// Take `block` out of the prefix cache whoever holds it (`evict_blocks`: its KV is
    /// bad). `len`: the manager's digest length. No new atomic step: the key's stripe, then
    /// the transitions an eviction (`claim_record`, to rc 0 as `reset` does) or a retraction
    /// (`retract`) makes, so each block's withdrawal is one step against every hit, pin,
    /// release, registration, eviction and retraction of it.
    pub fn withdraw(&self, block: u32, len: usize) -> Withdrawal {
        let state = self.state(block);
        loop {
            // A snapshot: unhashed at this read, the block is not in the cache; hashed, it
            // is checked again under its key's stripe.
            if !state.load().hashed() {
                return Withdrawal::NotCached;
            }
            // The key it is registered under: stable while it stays hashed. If it was
            // withdrawn and registered anew meanwhile, this read may give another key (or a
            // torn one), which the look under the stripe rejects.
            let key = self.index.stored(block, len);
            // Locked mode: the claim below may take a CACHED block out (`eviction_order`);
            // the policy's lock comes before the stripe, as for an eviction.
            let mut policy = self.order.guard();
            let stripe = lock(&self.stripes[stripe_of(&key)]);
            // Under the key's stripe every registration, claim and retraction of `key` is
            // wholly before or after this point, so an entry of `key` naming the block means
            // it is registered under `key`, and only this thread can unregister it now. (The
            // slot's Acquire load in `find` sees the digest words stored before it.)
            if self.index.get(&key) != Some(block) {
                // Withdrawn since the first read (the next one sees it unhashed), or
                // registered under another key: look again.
                drop(stripe);
                drop(policy);
                continue;
            }
            let mut was_pinned = false;
            let outcome = loop {
                let w = state.load();
                if w.rc() == 0 {
                    // CACHED: claimed as an eviction claims it, to rc 0 (FREE). Its LRU
                    // record goes stale with the generation; evictors skip it.
                    if state.claim_cached(w.generation(), 0) {
                        // The pin bit is constant while CACHED: this is the claimed word's.
                        was_pinned = w.pinned();
                        break Withdrawal::Freed;
                    }
                } else if state.unhash_held() {
                    // OWNED: as a retraction; a hit that pinned first keeps its reference.
                    break Withdrawal::Unhashed;
                }
                // A hit revived it, or its last holder released it, since the load: the CAS
                // failed, nothing changed; look at the new word.
            };
            self.index.remove(&key, block);
            let group = self.group_of(block);
            if let Some(log) = &self.events {
                log.push(KvEvent::BlockRemoved {
                    block_hash: key.keyed(group),
                    medium: Medium::Gpu,
                    group,
                });
            }
            drop(stripe);
            if let (Withdrawal::Freed, Some(policy)) = (outcome, policy.as_mut()) {
                if was_pinned {
                    // Outside the order, but a holder may have given it a retention: it
                    // goes with the content, as for any block that becomes FREE.
                    policy.set_retention(block, Retention::DEFAULT);
                } else {
                    policy.removed(block);
                }
            }
            if outcome == Withdrawal::Freed {
                // Under the policy's lock, in order with the tenant's other counts.
                self.count_cached(block, false);
            }
            drop(policy);
            if outcome == Withdrawal::Freed {
                // Relaxed: tallies (see the fields), moved before the block can be taken
                // (its taker names its own group). `available` already counts it: CACHED
                // before, FREE now. A taker holding a unit meanwhile finds it once pushed.
                self.cached.fetch_sub(1, Ordering::Relaxed);
                if let Some(t) = self.tally_of(block) {
                    down(&t.cached);
                }
                self.free.push(block);
                if was_pinned {
                    // A pinned CACHED block had no unit counted: it has one now, FREE.
                    // Relaxed: a tally. Release: the push is seen by its reserver.
                    self.pinned.fetch_sub(1, Ordering::Relaxed);
                    self.available.fetch_add(1, Ordering::Release);
                }
            }
            return outcome;
        }
    }
}
