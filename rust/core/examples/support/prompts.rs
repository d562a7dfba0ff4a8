//! The decode examples' prompts: sequence `i` gets `100 + i` pseudo-random tokens (xorshift,
//! fixed seed), so that every example steps the same batch shape.

pub fn decode_prompts(ids: &[u64]) -> Vec<Vec<u32>> {
    let mut seed = 3u64;
    ids.iter()
        .map(|&i| {
            (0..100 + i)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u32 >> 1
                })
                .collect()
        })
        .collect()
}
