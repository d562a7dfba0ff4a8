//! The pseudo-tokens of a trace prompt given as hash ids (`python/pagedkv/sim/requests.py`'s
//! `hash_id_tokens`, the numpy reference): token `j` of block id `h` is splitmix64 of
//! `h * block_tokens + j`, kept to 31 bits. A replay builds every admitted prompt's tokens
//! this way (145 M tokens per replay of the public conversation trace).

use crate::block_keys::finish;

/// The first `length` tokens of a prompt of `hash_ids`, `block_tokens` per id (ids past
/// those needed are ignored; a prompt longer than its ids gives only the ids' tokens).
pub fn hash_id_tokens(hash_ids: &[u64], length: usize, block_tokens: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(length.min(hash_ids.len() * block_tokens));
    'ids: for &h in hash_ids {
        let base = h.wrapping_mul(block_tokens as u64);
        for j in 0..block_tokens as u64 {
            if out.len() == length {
                break 'ids;
            }
            let x = base.wrapping_add(j).wrapping_add(0x9E37_79B9_7F4A_7C15);
            out.push((finish(x) & 0x7FFF_FFFF) as u32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_sharing() {
        let a = hash_id_tokens(&[3, 4], 5, 4);
        let b = hash_id_tokens(&[3, 9], 8, 4);
        assert_eq!(a.len(), 5);
        assert_eq!(b.len(), 8);
        assert_eq!(a[..4], b[..4]); // the same first id
        assert_ne!(a[4], b[4]);
        assert!(a.iter().all(|&t| t < 1 << 31));
        assert_eq!(hash_id_tokens(&[1], 10, 4).len(), 4);
    }
}
