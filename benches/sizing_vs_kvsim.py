"""Issue 35: `simulate --mrc-only` side by side with kvcache-simulator on one trace.

kvcache-simulator (`pip install kvcache-simulator`, 0.1.3) answers "what hit rate at which
cache size" for LRU, FIFO and an optimal bound. This script installs it into a venv of its own
when missing (`--venv`, default /work/venvs/kvsim: `python -m venv` and `pip install
kvcache-simulator==0.1.3`, which needs the package index; it compiles its C++ core with the
local `c++` on its first run, which is run once before the measured rounds and reported
apart), then runs, in turn, `--rounds` times each on the same trace:

- `kvsim`: `kvcache-simulator run --trace T --model llama-3.1-8b --kv-precision bf16_fp16
  --block-size 512 --format json` (LRU, FIFO, optimal at its default budgets);
- `pagedkv cache`: `python -m pagedkv simulate --trace T --block-size 512 --mrc-only
  --mrc-warmup 0.5` (the pure cache replay at block granularity: the curve, LRU, FIFO and the
  optimum at a few sizes);
- `pagedkv scheduled`: the same with `--mrc-replay scheduled` (the curve from a replay
  through the scheduler, the path `--mrc-only` took before issue 35).

Each process is timed by `os.wait4`: user + system CPU seconds of it and its children, peak RSS
(the largest of the process tree's), wall seconds. Medians and ranges per command follow, with
the ratio of medians to kvsim's.

Then the curves at kvsim's budgets (its cache blocks at each budget), not timed: kvsim's
LRU, FIFO and optimal; pagedkv's pure cache replay's LRU, FIFO and optimum over the same
window (`--mrc-warmup 0.5`: the last half of the requests in file order) and over every
request. How each counts a hit: kvsim counts, over the last half of the requests in file order,
the tokens of every looked-up block of the prompt's longest cached prefix, a partial last block
included (it caches partial blocks); its LRU and optimum evict leaves only (the prefix
constraint) and its FIFO does not; its optimum ranks by the next *request* using a block.
pagedkv caches full blocks only and caps a hit below the prompt's length (one token is always
computed, as vLLM does), counts the prompt tokens of the counted requests as the denominator,
and its optimum ranks by the next lookup of the block itself.

pagedkv from this checkout is compiled to bytecode before the rounds (`compileall`, what pip
does when it installs a wheel, and what kvsim's venv has), unless `--no-compile`: on a machine
where `PYTHONDONTWRITEBYTECODE` is set, each run would otherwise compile every module it imports
(about 0.05 CPU s of `simulate --mrc-only`'s, more before issue 35's lazy imports).

Run: `python benches/sizing_vs_kvsim.py [--trace T] [--rounds 5] [--out FILE.md]` (the trace:
`--trace`, else the shared Mooncake trace where `../shared/traces/` beside the checkout has it
or `PAGEDKV_MOONCAKE_TRACE` names it, else a synthetic one of its format written by
`tests/support/mooncake_trace.py`). pagedkv is this checkout's `python/` when its
extension is built there, else the installed package (CI: `.ci/lane-kvsim.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This checkout's package when its extension is built in place, else the installed one.
LOCAL = any((ROOT / "python" / "pagedkv").glob("_core*.so"))
if LOCAL:
    sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "support"))
KVSIM_VERSION = "0.1.3"
KVSIM_ARGS = ["--model", "llama-3.1-8b", "--kv-precision", "bf16_fp16", "--block-size", "512"]


def ensure_kvsim(venv: Path) -> Path:
    """The kvcache-simulator executable, installed into `venv` first when missing."""
    exe = venv / "bin" / "kvcache-simulator"
    if exe.exists():
        return exe
    print(f"installing kvcache-simulator=={KVSIM_VERSION} into {venv}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"kvcache-simulator=={KVSIM_VERSION}"], check=True)
    if not exe.exists():
        raise SystemExit(f"kvcache-simulator was installed but {exe} is missing")
    return exe


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run `cmd` (output discarded); its CPU seconds (children included), peak RSS, wall."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()}")
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "rss_mb": usage.ru_maxrss / 1024,
        "wall_s": wall,
    }


def commands(kvsim: Path, trace: Path, tmp: Path) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "pagedkv", "simulate", "--trace", str(trace)]
    mrc = ["--block-size", "512", "--mrc-only", "--no-progress"]
    return {
        "kvsim": [
            *(str(kvsim), "run", "--trace", str(trace), *KVSIM_ARGS, "--no-progress"),
            *("--format", "json", "-o", str(tmp / "kvsim.json")),
        ],
        "pagedkv cache": [*py, *mrc, "--mrc-warmup", "0.5", "--json", str(tmp / "cache.json")],
        "pagedkv scheduled": [
            *(*py, *mrc, "--mrc-replay", "scheduled"),
            *("--json", str(tmp / "scheduled.json")),
        ],
    }


def timing_table(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    base = statistics.median(r["cpu_s"] for r in runs["kvsim"])
    lines = [
        "| command | rounds | CPU s median (range) | vs kvsim | peak RSS MB median "
        "| wall s median |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in runs.items():
        cpu = [r["cpu_s"] for r in rs]
        med = statistics.median(cpu)
        lines.append(
            f"| {name} | {len(rs)} | {med:.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
            f"{med / base:.2f}x | {statistics.median(r['rss_mb'] for r in rs):.0f} | "
            f"{statistics.median(r['wall_s'] for r in rs):.2f} |"
        )
    return lines


def curve_table(kv: dict[str, Any], trace: Path) -> list[str]:
    """kvsim's points beside pagedkv's pure cache replay at the same block counts."""
    from pagedkv.sim.mrc_blocks import block_curve, block_replay, first_counted
    from pagedkv.sim.trace import read_trace

    w = read_trace(trace, limit=None, ms_per_step=20.0, trace_format="auto")
    rep = block_replay(w, 512)
    points = kv["points"]
    sizes = [int(p["cacheBlocks"]) for p in points]
    ours: dict[str, dict[str, list[float]]] = {}
    for label, warm in (("last half", 0.5), ("all", 0.0)):
        curve = block_curve(w, 512, warmup=warm, replay=rep)
        first = first_counted(w, warm)
        ours[label] = {
            p: [b * 512 / curve.prompt_tokens for b in rep.hits(sizes, p, first)]
            for p in ("lru", "fifo", "optimal")
        }
        assert all(
            abs(a - curve.hit_rate(n)) < 1e-12
            for a, n in zip(ours[label]["lru"], sizes, strict=True)
        ), "LRU's replay and the curve disagree"
    lines = [
        "| budget GiB | blocks | kvsim LRU | pagedkv LRU (last half) | pagedkv LRU (all) "
        "| kvsim FIFO | pagedkv FIFO (last half) | kvsim optimal | pagedkv optimal (last half) "
        "| pagedkv optimal (all) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(points):
        r = p["results"]
        lines.append(
            f"| {p['gib']:g} | {sizes[i]} | {r['lru']['hitRate']:.2%} | "
            f"{ours['last half']['lru'][i]:.2%} | {ours['all']['lru'][i]:.2%} | "
            f"{r['fifo']['hitRate']:.2%} | {ours['last half']['fifo'][i]:.2%} | "
            f"{r['optimal']['hitRate']:.2%} | {ours['last half']['optimal'][i]:.2%} | "
            f"{ours['all']['optimal'][i]:.2%} |"
        )
    lines.append("")
    lines.append(
        f"kvsim's hit-rate ceiling (every block ever seen kept): {kv['hitRateCeiling']:.2%}"
    )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--venv", type=Path, default=Path("/work/venvs/kvsim"))
    ap.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="leave this checkout's package without bytecode (by default it is compiled "
        "first, as pip compiles an installed wheel)",
    )
    args = ap.parse_args()
    kvsim = ensure_kvsim(args.venv)
    bytecode = "installed package" if not LOCAL else "as found in the checkout"
    if LOCAL and not args.no_compile:
        # What pip does when it installs the wheel (and kvsim's venv has): without bytecode on
        # disk, and with PYTHONDONTWRITEBYTECODE set as on the development machines, every
        # run would compile the package's sources again, a cost no installed package pays.
        pkg = ROOT / "python" / "pagedkv"
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True)
        bytecode = "the checkout's package compiled to bytecode first (compileall)"
    env = dict(os.environ)
    if LOCAL:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]
        )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.trace is None:
            from mooncake_trace import trace_path

            args.trace = trace_path(tmp)
        cmds = commands(kvsim, args.trace, tmp)
        first = measure(cmds["kvsim"])  # compiles its C++ core when not yet built
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cmds}
        for _ in range(args.rounds):
            for name, cmd in cmds.items():
                runs[name].append(measure(cmd, env))
        kv = json.loads((tmp / "kvsim.json").read_text())
        curves = curve_table(kv, args.trace)
    out = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, trace {args.trace.name}, "
        f"{args.rounds} rounds in turn; load average before: {os.getloadavg()[0]:.2f}; "
        f"pagedkv: {bytecode}",
        "",
        *timing_table(runs),
        "",
        f"kvsim's first run of this batch: {first['cpu_s']:.2f} CPU s (its C++ core is "
        "compiled on its first use ever and cached; that run is not in the table)",
        "",
        *curves,
    ]
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
