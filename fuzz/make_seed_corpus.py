"""Write the seed corpus of the `ops` fuzz target: deterministic, small, covering every
configuration (hash algorithm, caching on/off, swap space or none) and every opcode.

Run from the repository root: `python fuzz/make_seed_corpus.py` (rewrites fuzz/corpus/ops/seed-*).
"""

from __future__ import annotations

import random
from pathlib import Path

OUT = Path(__file__).parent / "corpus" / "ops"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("seed-*"):
        old.unlink()
    for i in range(32):
        rng = random.Random(i)
        # Header: num_blocks, block_size, cpu blocks, caching + algorithm (see Setup::decode).
        head = [rng.randrange(256), i % 4, rng.choice([0, 3, 8]), (i % 15)]
        n_ops = rng.randrange(10, 100)
        ops = []
        for k in range(n_ops):
            opcode = k % 16 if k < 16 else rng.randrange(16)
            ops += [opcode, rng.randrange(256), rng.randrange(256), rng.randrange(256)]
        (OUT / f"seed-{i:02d}").write_bytes(bytes(head + ops))


if __name__ == "__main__":
    main()
