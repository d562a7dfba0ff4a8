#!/usr/bin/env bash
# CI lane: `simulate --mrc-only` side by side with kvcache-simulator (issue 35's benchmark,
# benches/sizing_vs_kvsim.py): installs kvcache-simulator 0.1.3 into a venv of its own (from
# the package index; it compiles its C++ core with the local c++ on first use), runs both in
# turn and prints the CPU-time table and the curves at its budgets. pagedkv must already be
# importable by $PYTHON (the CI's venv with the built wheel, or a checkout with the extension
# built in python/pagedkv). Fails, never skips, when kvcache-simulator cannot be installed or
# run. The trace: ../shared/traces/mooncake_synthetic_trace.jsonl where present, else a
# synthetic one of its format. About 30 MB of venv, removed at the end; 1-2 minutes.
# Usage: .ci/lane-kvsim.sh [ROUNDS]   (default 3)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV_KVSIM:-$ROOT/.venv-kvsim}"
ROUNDS="${1:-3}"
export PIP_NO_CACHE_DIR=1
disk_free() { df -h "$ROOT" "${TMPDIR:-/tmp}" 2>/dev/null | sed 's/^/    /' || true; }
cleanup() { rm -rf "$VENV"; echo "free disk after the lane (venv removed):"; disk_free; }
trap cleanup EXIT
echo "free disk before the lane:"; disk_free
command -v c++ >/dev/null || { echo "lane-kvsim: no c++ compiler for kvcache-simulator's core" >&2; exit 1; }
rm -rf "$VENV"
start=$(date +%s)
"$PYTHON" benches/sizing_vs_kvsim.py --venv "$VENV" --rounds "$ROUNDS"
echo "lane-kvsim: done in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1) of venv)"
