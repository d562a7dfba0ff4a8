"""Lookup latency per form of a request's hashes, pagedkv alone, on a dumped stream
(benches/router_dump.py writes one): a lighter run than the side-by-side benchmark, for
comparing two builds in turn on the same machine minute (run it with each build's package
first on the path, alternately).

    python benches/router_lookup_forms.py DUMP [--passes 3]
    python benches/router_lookup_forms.py --reading-only   # the hashes' reading alone

With a dump: the payloads applied to a fresh index, then each of its lookups timed one by
one (`scores`), as a list of ints, a uint64 array and bytes; p50, p90, p99 per form.
`--reading-only`: requests of 374 random hashes (below 2**62, and above 2**63) that no
engine holds, so that a lookup stops at its first block and its time is reading the
argument; the median call over 20 rounds of 200, per form.
"""

from __future__ import annotations

import argparse
import random
import struct
import time
from pathlib import Path

import numpy as np

from pagedkv.router import RouterIndex


def load(path: Path) -> tuple[RouterIndex, list[list[int]]]:
    """The dump's payloads applied to a fresh index, and its lookups."""
    b = path.read_bytes()
    ix = RouterIndex()
    lookups: list[list[int]] = []
    i = 0
    while i < len(b):
        kind = b[i]
        i += 1
        if kind == 1:
            engine, n = struct.unpack_from("<QI", b, i)
            i += 12
            ix.apply(engine, b[i : i + n])
            i += n
        else:
            (n,) = struct.unpack_from("<I", b, i)
            i += 4
            lookups.append(list(struct.unpack_from(f"<{n}Q", b, i)))
            i += 8 * n
    return ix, lookups


def forms(lookups: list[list[int]]) -> dict[str, list[object]]:
    arrays = [np.array(q, dtype=np.uint64) for q in lookups]
    return {"list": list(lookups), "ndarray": list(arrays), "bytes": [a.tobytes() for a in arrays]}


def timed(dump: Path, passes: int) -> None:
    ix, lookups = load(dump)
    print(f"memberships {ix.stats().memberships}, {len(lookups)} lookups", flush=True)
    clock = time.perf_counter_ns
    for form, qs in forms(lookups).items():
        lat = []
        for _ in range(passes):
            for q in qs:
                t0 = clock()
                ix.scores(q)  # type: ignore[arg-type]
                lat.append(clock() - t0)
        lat.sort()
        p = [lat[len(lat) * k // 100] / 1000 for k in (50, 90, 99)]
        print(f"{form:8s} p50 {p[0]:.2f}  p90 {p[1]:.2f}  p99 {p[2]:.2f} us", flush=True)


def reading_only() -> None:
    ix = RouterIndex()
    rng = random.Random(1)
    for label, lo, hi in (("below 2**62", 1 << 40, 1 << 62), ("above 2**63", 1 << 63, 1 << 64)):
        lookups = [[rng.randrange(lo, hi) for _ in range(374)] for _ in range(200)]
        for form, qs in forms(lookups).items():
            rounds = []
            for _ in range(20):
                t0 = time.perf_counter_ns()
                for q in qs:
                    ix.scores(q)  # type: ignore[arg-type]
                rounds.append((time.perf_counter_ns() - t0) / len(qs))
            med = sorted(rounds)[len(rounds) // 2]
            print(f"{label} {form:8s} {med / 1000:.2f} us a call, {med / 374:.1f} ns a hash")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dump", type=Path, nargs="?")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--reading-only", action="store_true")
    a = p.parse_args()
    if a.reading_only:
        reading_only()
    elif a.dump is None:
        p.error("a dump file, or --reading-only")
    else:
        timed(a.dump, a.passes)


if __name__ == "__main__":
    main()
