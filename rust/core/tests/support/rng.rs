//! The thread tests' seeded generator (xorshift64; no dependency).

pub struct Rng(pub u64);

impl Rng {
    /// The next value below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
