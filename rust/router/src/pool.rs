//! Memory for the block map's large tables, in 2 MiB transparent huge pages (Linux).
//!
//! Why: a walk probes random slots of tables far beyond the TLB's reach (10 M memberships:
//! 128 MB of tables, 32 K pages of 4 KiB, against a TLB of a few thousand entries), so most
//! probes also miss the TLB, and in a VM each miss is a nested page walk. In 2 MiB pages the
//! same tables are 64 pages (benches/results/issue34-router.md, fourth pass, has the A/B).
//!
//! The kernel backs memory with a huge page only where a whole 2 MiB-aligned range lies in
//! one mapping marked `MADV_HUGEPAGE` (THP mode `madvise`, or `always`). A shard's table is
//! smaller than that (0.5 MB at 10 M), so tables share 2 MiB chunks, one table size a chunk
//! (a slab); a table over half a huge page gets a mapping of its own. Tables under
//! `MIN_BYTES` stay on the heap: an index that small is within the TLB's reach, and the many
//! small indexes of a test process would otherwise take 2 MiB each.
//!
//! A chunk's pages are faulted in when a table is first written into it (by the writer that
//! grows a table, under its shard's lock): with THP `defrag` at `madvise` the kernel may
//! compact memory there to find a huge page. Lookups never fault: a table is written whole
//! before any lookup sees it.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// A huge page.
const HUGE: usize = 2 << 20;
/// Tables of fewer bytes stay on the heap (a shard's table at 16 KiB: 4 MB for the 256
/// shards, within the TLB's reach; 128 of them fill a chunk: `Chunk::used` has room).
const MIN_BYTES: usize = 16 << 10;
/// Empty chunks kept mapped for the next tables (the tables of a growing index move up one
/// size at a time, emptying the chunks of the size below): a reused chunk's pages are
/// resident already, where a fresh one faults them in. At most this many, and at most a
/// sixteenth of what is mapped (a small index keeps none).
const SPARE: usize = 4;

/// The chunks and mappings of one block map's tables.
#[derive(Default)]
pub(crate) struct Pool {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Chunks holding at least one table.
    chunks: Vec<Chunk>,
    /// Empty chunks, still mapped (at most `SPARE`).
    spare: Vec<usize>,
    /// Bytes mapped: chunks (spare ones too) and tables' own mappings.
    mapped: usize,
}

/// A 2 MiB chunk cut into tables of `size` bytes.
struct Chunk {
    base: usize,
    size: usize,
    /// Bit i: the table at `base + i * size` is in use (HUGE / MIN_BYTES = 128 tables at most).
    used: u128,
}

impl Chunk {
    fn spots(&self) -> usize {
        HUGE / self.size
    }
}

impl Pool {
    /// `bytes` (at least `MIN_BYTES`) from huge-page memory; None where there is none (the
    /// caller uses the heap).
    fn alloc(&self, bytes: usize) -> Option<NonNull<u8>> {
        debug_assert!(bytes >= MIN_BYTES);
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if bytes > HUGE / 2 {
            let len = bytes.next_multiple_of(HUGE);
            let at = map_huge(len)?;
            p.mapped += len;
            return NonNull::new(at as *mut u8);
        }
        if let Some(c) = p
            .chunks
            .iter_mut()
            .find(|c| c.size == bytes && c.used.count_ones() < c.spots() as u32)
        {
            let i = (!c.used).trailing_zeros() as usize;
            c.used |= 1 << i;
            return NonNull::new((c.base + i * bytes) as *mut u8);
        }
        let base = match p.spare.pop() {
            Some(b) => b,
            None => {
                let b = map_huge(HUGE)?;
                p.mapped += HUGE;
                b
            }
        };
        p.chunks.push(Chunk {
            base,
            size: bytes,
            used: 1,
        });
        NonNull::new(base as *mut u8)
    }

    /// Give back what `alloc(bytes)` returned at `at`.
    fn free(&self, at: usize, bytes: usize) {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if bytes > HUGE / 2 {
            let len = bytes.next_multiple_of(HUGE);
            unmap(at, len);
            p.mapped -= len;
            return;
        }
        let Some(ci) = p
            .chunks
            .iter()
            .position(|c| c.base <= at && at < c.base + HUGE)
        else {
            debug_assert!(false, "a pooled table outside every chunk");
            return;
        };
        let c = &mut p.chunks[ci];
        c.used &= !(1 << ((at - c.base) / c.size));
        if c.used == 0 {
            let base = p.chunks.swap_remove(ci).base;
            if p.spare.len() < SPARE && (p.spare.len() + 1) * HUGE * 16 <= p.mapped {
                p.spare.push(base);
            } else {
                unmap(base, HUGE);
                p.mapped -= HUGE;
            }
        }
    }

    /// Bytes mapped for tables (whole chunks, used or not, and spare ones).
    pub fn mapped(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).mapped
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Every table returned its memory before the pool goes (each holds an `Arc` of it),
        // so only the spare chunks are left.
        let p = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        debug_assert!(p.chunks.is_empty());
        for &b in &p.spare {
            unmap(b, HUGE);
        }
    }
}

/// A mapping of `len` bytes (a multiple of `HUGE`) aligned to `HUGE` and marked for huge
/// pages; its address, or None if the kernel refused.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<usize> {
    // Map one huge page more than asked, then cut the unaligned ends off.
    let over = len + HUGE;
    // SAFETY: a fresh anonymous private mapping at an address the kernel picks: no existing
    // memory is touched; the result is checked for failure before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let start = p as usize;
    let base = start.next_multiple_of(HUGE);
    if base > start {
        unmap(start, base - start);
    }
    let end = start + over;
    if end > base + len {
        unmap(base + len, end - (base + len));
    }
    // SAFETY: `base..base + len` lies in the mapping made above, which nothing else knows of
    // yet; MADV_HUGEPAGE changes how the kernel backs it, never its contents. A refusal
    // (THP compiled out) leaves 4 KiB pages, which is still correct memory.
    unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    Some(base)
}

#[cfg(not(target_os = "linux"))]
fn map_huge(_len: usize) -> Option<usize> {
    None
}

#[cfg(target_os = "linux")]
fn unmap(at: usize, len: usize) {
    // SAFETY: `at..at + len` is a range this module mapped and no table uses any more.
    let rc = unsafe { libc::munmap(at as *mut libc::c_void, len) };
    debug_assert_eq!(rc, 0);
}

#[cfg(not(target_os = "linux"))]
fn unmap(_at: usize, _len: usize) {}

/// A table's slots: `len` values of `T`, from the pool (huge pages) when large enough,
/// else from the heap; owned, like a `Box<[T]>`.
pub(crate) struct Slab<T> {
    ptr: NonNull<T>,
    len: usize,
    /// The pool the memory came from; None: the heap (a `Box<[T]>` taken apart).
    pool: Option<Arc<Pool>>,
}

// SAFETY: a Slab owns its values alone, as a Box<[T]> does: sending it or sharing `&Slab`
// sends or shares only `T`s (and an `Arc<Pool>`, whose state is under its mutex).
unsafe impl<T: Send> Send for Slab<T> {}
// SAFETY: as above: `&Slab<T>` gives out only `&T`s.
unsafe impl<T: Sync> Sync for Slab<T> {}

impl<T: Copy> Slab<T> {
    pub fn empty() -> Self {
        Self::from_box(Box::new([]))
    }

    fn from_box(b: Box<[T]>) -> Self {
        let len = b.len();
        // Box::into_raw never returns null.
        let ptr = NonNull::new(Box::into_raw(b).cast::<T>()).expect("a box is never null");
        Self {
            ptr,
            len,
            pool: None,
        }
    }

    /// `len` copies of `value`, in `pool`'s huge pages when `len` of them take at least
    /// `MIN_BYTES`.
    pub fn filled(len: usize, value: T, pool: &Arc<Pool>) -> Self {
        let bytes = len * std::mem::size_of::<T>();
        if bytes >= MIN_BYTES {
            if let Some(at) = pool.alloc(bytes) {
                let ptr = at.cast::<T>();
                for i in 0..len {
                    // SAFETY: the pool gave `bytes` = len * size_of::<T>() bytes at `ptr`, used
                    // by nothing else, aligned for T (a 2 MiB-aligned chunk, the table at a
                    // multiple of `bytes`, itself a multiple of T's size and so of its
                    // alignment); writing initialises them, reading none.
                    unsafe { ptr.as_ptr().add(i).write(value) };
                }
                return Self {
                    ptr,
                    len,
                    pool: Some(Arc::clone(pool)),
                };
            }
        }
        Self::from_box(vec![value; len].into_boxed_slice())
    }

    /// Whether the memory is the pool's (counted in `Pool::mapped`), not the heap's.
    pub fn pooled(&self) -> bool {
        self.pool.is_some()
    }
}

impl<T> Deref for Slab<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised `T`s (`filled`, or a box's), owned by this
        // Slab until it drops; a shared borrow of the Slab lends them shared.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> DerefMut for Slab<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; the exclusive borrow of the Slab makes this one exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Drop for Slab<T> {
    fn drop(&mut self) {
        // `T: Copy` for every Slab made (`filled`, `empty`): nothing to drop in the values.
        match &self.pool {
            Some(pool) => pool.free(
                self.ptr.as_ptr() as usize,
                self.len * std::mem::size_of::<T>(),
            ),
            None => {
                let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
                // SAFETY: `ptr` and `len` are those of the Box<[T]> `from_box` took apart,
                // and nothing else has them.
                drop(unsafe { Box::from_raw(raw) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tables of one size share a chunk; each reads back what was written into it; a chunk
    /// emptied is unmapped, or kept as a spare while the spares are a sixteenth of what is
    /// mapped, and a spare is reused for another size; a table over half a huge page has a
    /// mapping of its own; small tables stay on the heap.
    #[test]
    fn tables_share_chunks_and_give_them_back() {
        let pool = Arc::new(Pool::default());
        let small = Slab::filled(MIN_BYTES / 8 - 1, 1u64, &pool);
        assert!(!small.pooled());
        let one = Slab::filled(MIN_BYTES / 8, 2u64, &pool);
        if cfg!(target_os = "linux") {
            assert!(
                one.pooled(),
                "a 16 KiB table is cut from a huge-page chunk on Linux"
            );
        } else if !one.pooled() {
            return; // no huge-page mappings on this system: the heap serves every table
        }
        assert_eq!(pool.mapped(), HUGE);
        drop(one); // a pool of 2 MiB keeps no spare
        assert_eq!(pool.mapped(), 0);

        let half = HUGE / 2 / 8;
        let mut a: Vec<Slab<u64>> = (0..33).map(|i| Slab::filled(half, i, &pool)).collect();
        assert_eq!(pool.mapped(), 17 * HUGE); // two tables a chunk
        for (i, s) in a.iter_mut().enumerate() {
            assert!(s.iter().all(|&v| v == i as u64));
            s[half - 1] = 1000 + i as u64;
        }
        assert_eq!(a[31][half - 1], 1031);
        assert_eq!(a[32][half - 2], 32);

        let big = Slab::filled(HUGE / 8 + 1, 7u64, &pool);
        assert!(big.pooled());
        assert_eq!(pool.mapped(), 19 * HUGE);
        drop(big);
        assert_eq!(pool.mapped(), 17 * HUGE);

        a.truncate(32); // the 17th chunk empties: kept, 2 MiB of 34
        assert_eq!(pool.mapped(), 17 * HUGE);
        let other = Slab::filled(half / 2, 5u64, &pool); // another size takes the spare
        assert_eq!(pool.mapped(), 17 * HUGE);
        assert!(other.iter().all(|&v| v == 5));
        drop(other); // spare again
        drop(a); // one spare is kept (a second would be more than a sixteenth)
        assert_eq!(pool.mapped(), HUGE);
    }

    /// A chunk of the smallest pooled size holds 128 tables, every bit of its `used` mask:
    /// the 128th still goes in the first chunk, the 129th opens a second; each table keeps
    /// its own contents, and freeing the first chunk's last table (bit 127) empties it.
    #[test]
    fn the_smallest_tables_fill_every_bit_of_a_chunk() {
        let pool = Arc::new(Pool::default());
        let n = MIN_BYTES / 8;
        let first = Slab::filled(n, 0u64, &pool);
        if cfg!(target_os = "linux") {
            assert!(first.pooled());
        } else if !first.pooled() {
            return;
        }
        let mut all = vec![first];
        all.extend((1..128u64).map(|i| Slab::filled(n, i, &pool)));
        assert_eq!(HUGE / MIN_BYTES, 128);
        assert_eq!(pool.mapped(), HUGE, "128 tables fit in one chunk");
        all.push(Slab::filled(n, 128, &pool));
        assert_eq!(pool.mapped(), 2 * HUGE, "the 129th opens a second chunk");
        for (i, s) in all.iter_mut().enumerate() {
            assert!(
                s.iter().all(|&v| v == i as u64),
                "table {i} was overwritten"
            );
            s[0] = 1000 + i as u64;
        }
        assert!(all.iter().enumerate().all(|(i, s)| s[0] == 1000 + i as u64));
        // The first chunk's tables go, bit 0 first and bit 127 last: the chunk empties
        // only then, and is unmapped (not kept as a spare: 2 MiB is more than a sixteenth
        // of the 4 MiB mapped).
        let last = all.pop().unwrap();
        for s in all.drain(..127) {
            drop(s);
            assert_eq!(pool.mapped(), 2 * HUGE);
        }
        drop(all.pop().unwrap());
        assert_eq!(pool.mapped(), HUGE);
        drop(last);
        assert_eq!(pool.mapped(), 0);
    }
}
