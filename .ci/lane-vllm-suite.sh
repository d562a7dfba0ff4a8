#!/usr/bin/env bash
# One vLLM release's lane: vLLM's own scheduler tests with pagedkv's manager swapped in (with
# the release's gate, testing/vllm_suite/run.py MIN_PASSED_BY_VERSION), then pagedkv's own
# vLLM tests under it (tests/vllm: the interface pin test_protocol.py, test_compat.py, the
# differential and tier tests; -m "not manual", as .ci/run's pytest step).
#
# Usage: .ci/lane-vllm-suite.sh VERSION      (a release pinned in testing/vllm_suite/pins.py)
#
# Runs in the active Python environment, which must hold pagedkv installed with the test
# extras and .ci/vllm-requirements.txt (as .ci/run installs them). vLLM itself is installed
# here with --no-deps: VERSION replaces whatever vLLM the environment holds (0.34.0's torch
# pin is 2.14.0, the one .ci/vllm-requirements.txt holds, so no second torch is installed),
# plus the dependency floors that release raised beyond the requirements file. Run the lanes
# oldest release first: a lane leaves its vLLM installed. Fails, never skips, when vLLM
# cannot be imported or is not VERSION.
set -euo pipefail

VERSION="${1:?usage: $0 VERSION (e.g. 0.34.0)}"
cd "$(dirname "$0")/.."
ROOT="$PWD"
export PIP_NO_CACHE_DIR=1
disk_free() { df -h . "${TMPDIR:-/tmp}" 2>/dev/null | sed 's/^/    /' || true; }
echo "free disk before the vLLM $VERSION lane:"; disk_free
trap 'echo "!!! the vLLM $VERSION lane failed (exit $?); free disk now:" >&2; disk_free >&2' ERR

# What each release requires beyond .ci/vllm-requirements.txt (0.33.0's): 0.34.0 raised these
# floors in its dependency list (its wheel's METADATA); everything else it imports is there.
case "$VERSION" in
    0.33.0) EXTRA=() ;;
    0.34.0) EXTRA=("mistral_common[image]>=1.13.0" "huggingface_hub>=2.0.0" "tokenizers>=0.23.3"
                   "filelock>=4.2.4") ;;
    *) echo "no lane for vLLM $VERSION: add it to testing/vllm_suite/pins.py and here" >&2; exit 1 ;;
esac
python -m pip install --quiet --no-deps "vllm==$VERSION"
if [ "${#EXTRA[@]}" -gt 0 ]; then python -m pip install --quiet "${EXTRA[@]}"; fi
installed="$(python -c 'import vllm; print(vllm.__version__)')"
if [ "${installed%%+*}" != "$VERSION" ]; then
    echo "vLLM $installed is installed where the lane needs $VERSION" >&2
    exit 1
fi

# The sdist (sha256-pinned) and the fake Hugging Face cache go to the git-ignored
# .vllm-tests/VERSION/, removed when the lane is done.
PYTHONPATH="$ROOT/testing${PYTHONPATH:+:$PYTHONPATH}" python -m vllm_suite.fetch --version "$VERSION"
PYTHONPATH="$ROOT/testing${PYTHONPATH:+:$PYTHONPATH}" python -m vllm_suite.run --version "$VERSION" \
    --manager pagedkv.vllm:KVCacheManager \
    --json "$ROOT/.vllm-tests/scheduler-pagedkv-$VERSION.json" --timeout 1800 --gate

# pagedkv's own vLLM tests, against the installed wheel (run from outside the source tree, as
# .ci/run does).
cd "$(mktemp -d)"
python -m pytest -q -p no:cacheprovider -c "$ROOT/pyproject.toml" --rootdir "$ROOT" \
    -m "not manual" "$ROOT/tests/vllm"
cd "$ROOT"

rm -rf "$ROOT/.vllm-tests/$VERSION/tree" "$ROOT/.vllm-tests/$VERSION/hf-home" \
    "$ROOT/.vllm-tests/$VERSION/vllm-$VERSION.tar.gz"
echo "free disk after the vLLM $VERSION lane:"; disk_free
