//! One word of 64 holders read for a lookup under the word's generation (`slots.rs`): the
//! live mask, then each block's bits narrowing it, then the holders' meta; the whole read
//! again if a holder of the word was retired meanwhile. `lookup.rs` runs it over the block
//! map; the loom model (`loom_models/lookup_word.rs`) runs it over a model of the bits.

use crate::lookup::RawHit;
use crate::slots::{unpack_meta, Slots};

/// A request's blocks, as one word's bits: `start` before each read of word `w`, then
/// `bits(i)` for `i = 0, 1, ...` in order until no holder is left or `len` is reached.
pub(crate) trait Blocks {
    fn len(&self) -> usize;
    fn start(&mut self, w: usize);
    /// The holders of word `w` that hold block `i` (each bit one the engine held at some
    /// moment of the read: Acquire, as `BlockMap::bits`'s read lock is).
    fn bits(&mut self, w: usize, i: usize) -> u64;
}

/// Appends to `out` each holder of word `w` live when the read began, with its leading
/// blocks held; returns whether it found any. A slot retired (and maybe reused) while it
/// was read makes it read the word again, so no answer mixes two holders of one slot.
#[inline]
pub(crate) fn read_word(
    slots: &Slots,
    w: usize,
    blocks: &mut impl Blocks,
    out: &mut Vec<RawHit>,
) -> bool {
    loop {
        #[cfg(all(test, not(loom)))]
        crate::lookup::tests::hook(w, None);
        let g0 = slots.gen(w);
        let active = slots.live(w);
        if active == 0 {
            return false;
        }
        let start = out.len();
        let mut alive = active;
        let mut depth = blocks.len();
        blocks.start(w);
        for i in 0..blocks.len() {
            let still = alive & blocks.bits(w, i);
            if i > 0 {
                push_bits(out, w, alive & !still, i);
            }
            alive = still;
            if alive == 0 {
                depth = i;
                break;
            }
        }
        push_bits(out, w, alive, depth);
        for h in &mut out[start..] {
            let (engine, medium, group) = unpack_meta(slots.meta(h.engine));
            *h = RawHit {
                engine,
                medium,
                group,
                blocks: h.blocks,
            };
        }
        // Unchanged: no holder of the word was retired since `g0`, so every bit read was
        // its live holder's (a bit changed by a retirement's clearing, or by a new holder of
        // a reused slot, is read only after its generation moved).
        if slots.gen(w) == g0 {
            return out.len() > start;
        }
        out.truncate(start);
    }
}

/// Records the holders of `bits` (in word `w`) as holding `depth` blocks; the slot goes in
/// `engine` until the caller reads its meta.
#[inline]
fn push_bits(out: &mut Vec<RawHit>, w: usize, mut bits: u64, depth: usize) {
    while bits != 0 {
        let b = bits.trailing_zeros();
        bits &= bits - 1;
        out.push(RawHit {
            engine: (w as u32) * 64 + b,
            medium: 0,
            group: 0,
            blocks: depth as u32,
        });
    }
}
