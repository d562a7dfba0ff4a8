//! Content keys of full blocks (`python/pagedkv/sim/block_keys.py` has the derivation):
//!
//! ```text
//! c_i = sum_j finish(token_{iB+j} + 1) * Q^(B-1-j)      (mod 2^64)
//! K_i = K_{i-1} * P + c_i                              (K_-1: the salt and LoRA root)
//! key_i = finish(K_i)
//! ```
//!
//! Python computes the chain unrolled with numpy; here it is the plain recurrence, which gives
//! the same numbers (all arithmetic wraps mod 2^64 in both).

const P: u64 = 0x9E37_79B9_7F4A_7C15;
const Q: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// splitmix64's finaliser: every output bit depends on every input bit.
pub fn finish(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `c` of one full block.
pub fn content(block: &[u32]) -> u64 {
    // Horner's rule: the first token ends with Q^(B-1), the last with Q^0.
    block.iter().fold(0u64, |acc, &t| {
        acc.wrapping_mul(Q)
            .wrapping_add(finish(u64::from(t).wrapping_add(1)))
    })
}

/// One chain step: the key of a block with content `c` after chain state `state`, and the
/// new state.
pub fn step(state: u64, c: u64) -> (u64, u64) {
    let raw = state.wrapping_mul(P).wrapping_add(c);
    (finish(raw), raw)
}

/// Append the keys of the full blocks of `tokens` (a trailing partial block is ignored) after
/// chain state `state` to `out`; returns the state after the last one.
pub fn chain(mut state: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) -> u64 {
    out.reserve(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let (key, raw) = step(state, content(block));
        out.push(key);
        state = raw;
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horner_equals_the_sum_of_powers() {
        let block = [5u32, 0, 7, 1 << 31];
        let mut want = 0u64;
        for (j, &t) in block.iter().enumerate() {
            let mut w = 1u64;
            for _ in 0..(block.len() - 1 - j) {
                w = w.wrapping_mul(Q);
            }
            want = want.wrapping_add(finish(u64::from(t) + 1).wrapping_mul(w));
        }
        assert_eq!(content(&block), want);
    }

    #[test]
    fn chain_continues_where_it_stopped() {
        let toks: Vec<u32> = (0..40).collect();
        let mut whole = Vec::new();
        let end = chain(9, &toks, 4, &mut whole);
        let mut parts = Vec::new();
        let mid = chain(9, &toks[..16], 4, &mut parts);
        let end2 = chain(mid, &toks[16..], 4, &mut parts);
        assert_eq!(whole, parts);
        assert_eq!(end, end2);
        assert_eq!(whole.len(), 10);
    }

    #[test]
    fn keys_depend_on_the_prefix() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        chain(1, &[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut a);
        chain(1, &[9, 2, 3, 4, 5, 6, 7, 8], 4, &mut b);
        assert_ne!(a[1], b[1]); // same second block, different first
        assert_eq!(content(&[5, 6, 7, 8]), content(&[5, 6, 7, 8]));
    }
}
