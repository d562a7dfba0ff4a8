#!/usr/bin/env bash
# CI lane: the loom models of the router's concurrency protocols (rust/router/src/loom_models/:
# the replaced-holders queue against a writer short of slots, and a lookup's read of one word
# of holders against a commit and a slot's reuse). Every interleaving of two or three threads
# (a preemption bound of 3 or 4 on the three-thread ones), on the crate's own code: slots.rs and
# replaced.rs take loom's atomics and locks under --cfg loom (src/sync.rs). Fails on any model's
# failure, on a compile error, or when loom is missing from Cargo.lock (--locked).
# Its own target dir, target/loom-router (about 230 MB, kept as the build cache, as the core's
# target/loom is); about 1 minute cold on 2 cores (build 50 s, models 35 s), 35 s warm.
# Usage: .ci/lane-router-loom.sh   (from anywhere; needs a Rust toolchain)
set -euo pipefail

cd "$(dirname "$0")/.."
disk_free() { df -h . "${TMPDIR:-/tmp}" 2>/dev/null | sed 's/^/    /' || true; }
echo "free disk before the lane:"; disk_free
trap 'echo "free disk after the lane:"; disk_free' EXIT
# Empty stdin for every rustc, as .ci/run's cargo steps (.ci/rustc-no-stdin explains why).
export RUSTC_WRAPPER="${RUSTC_WRAPPER:-$PWD/.ci/rustc-no-stdin}"
start=$(date +%s)
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom-router \
    cargo test -p pagedkv-router --release --lib --locked loom_models </dev/null
echo "lane-router-loom: done in $(( $(date +%s) - start )) s"
