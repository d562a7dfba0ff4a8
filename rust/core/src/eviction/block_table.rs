//! A policy's per-block table: dense (one slot per pool block, for the pool-wide instance
//! that most blocks pass through) or sparse (a hash map of the blocks the instance knows,
//! for a tenant's own instance: sized by what the tenant holds, not by the pool).
//!
//! A sparse table reads a block it does not hold as its default value and makes the entry
//! on the first write; the policy drops a block's entry (`drop_block`) when the block leaves
//! it (evicted, removed, moved to another instance), so the map holds the instance's cached
//! and held blocks only. The dense table keeps whatever the slot held, as before: every
//! policy overwrites what it reads of a block before it places it anew.

use crate::alloc::try_filled;
use crate::error::Result;
use crate::id_hasher::BuildIdHasher;
use std::collections::HashMap;
use std::ops::{Index, IndexMut};

/// How a new policy keeps its per-block tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tables {
    /// A slot for each of the pool's blocks, allocated up front (fallibly).
    Dense(usize),
    /// Entries for the blocks the instance knows, made as they come.
    Sparse,
}

pub(crate) enum BlockTable<T> {
    Dense(Vec<T>),
    Sparse {
        map: HashMap<u32, T, BuildIdHasher>,
        default: T,
    },
}

impl<T: Copy> BlockTable<T> {
    /// Every block at `value`; `what` names the table in an `OutOfMemory` error (dense).
    pub(crate) fn new(tables: Tables, value: T, what: &str) -> Result<Self> {
        Ok(match tables {
            Tables::Dense(n) => Self::Dense(try_filled(n, value, what)?),
            Tables::Sparse => Self::Sparse {
                map: HashMap::default(),
                default: value,
            },
        })
    }

    /// `block` left the instance: a sparse table forgets it (and gives memory back once a
    /// quarter full); a dense one keeps the slot as it is.
    pub(crate) fn drop_block(&mut self, block: u32) {
        if let Self::Sparse { map, .. } = self {
            map.remove(&block);
            if map.capacity() > 64 && map.len() < map.capacity() / 4 {
                map.shrink_to(map.len() * 2);
            }
        }
    }

    /// Set every slot with `f` (dense), or forget every block (sparse: all at the default).
    pub(crate) fn reset(&mut self, f: impl FnMut(&mut T)) {
        match self {
            Self::Dense(v) => v.iter_mut().for_each(f),
            Self::Sparse { map, .. } => *map = HashMap::default(),
        }
    }

    /// Every slot that may differ from the default: all of a dense table's, a sparse one's
    /// entries. In no particular order.
    pub(crate) fn slots(&self) -> Box<dyn Iterator<Item = &T> + '_> {
        match self {
            Self::Dense(v) => Box::new(v.iter()),
            Self::Sparse { map, .. } => Box::new(map.values()),
        }
    }

    /// Heap bytes the table takes (its capacity; a hash map's control bytes counted).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Self::Dense(v) => v.capacity() * size_of::<T>(),
            Self::Sparse { map, .. } => map.capacity() * (size_of::<(u32, T)>() + 1),
        }
    }
}

impl<T: Copy> Index<usize> for BlockTable<T> {
    type Output = T;
    fn index(&self, block: usize) -> &T {
        match self {
            Self::Dense(v) => &v[block],
            Self::Sparse { map, default } => map.get(&(block as u32)).unwrap_or(default),
        }
    }
}

impl<T: Copy> IndexMut<usize> for BlockTable<T> {
    fn index_mut(&mut self, block: usize) -> &mut T {
        match self {
            Self::Dense(v) => &mut v[block],
            Self::Sparse { map, default } => map.entry(block as u32).or_insert(*default),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_table_holds_only_what_was_written_and_not_dropped() {
        let mut t = BlockTable::new(Tables::Sparse, 7u64, "t").unwrap();
        assert_eq!(t[1_000_000], 7);
        assert_eq!(t.slots().count(), 0, "a read makes no entry");
        t[5] = 9;
        t[1_000_000] += 1;
        assert_eq!((t[5], t[1_000_000], t[6]), (9, 8, 7));
        assert_eq!(t.slots().count(), 2);
        t.drop_block(5);
        assert_eq!((t[5], t.slots().count()), (7, 1));
        for b in 0..10_000 {
            t[b] = 1;
        }
        let full = t.bytes();
        for b in 0..10_000 {
            t.drop_block(b as u32);
        }
        assert!(t.bytes() < full / 8, "{} of {full}", t.bytes());
        t.reset(|_| unreachable!());
        assert_eq!(t.slots().count(), 0);
    }

    #[test]
    fn a_dense_table_is_a_vector() {
        let mut t = BlockTable::new(Tables::Dense(4), 0u8, "t").unwrap();
        t[3] = 2;
        t.drop_block(3);
        assert_eq!(t[3], 2, "dense slots stay");
        t.reset(|x| *x = 5);
        assert_eq!(t.slots().copied().collect::<Vec<_>>(), vec![5; 4]);
        assert_eq!(t.bytes(), 4);
    }
}
