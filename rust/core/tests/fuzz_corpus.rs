//! Replays every input of the fuzz corpus (`fuzz/corpus/ops/`) through the fuzz target's
//! interpreter, on stable Rust: what cargo-fuzz found (or was seeded with) stays fixed.
#![cfg(not(loom))]

#[path = "support/ops.rs"]
mod ops;

#[test]
fn fuzz_corpus_replays_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/ops");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 24,
        "the seed corpus has {} files",
        files.len()
    );
    let mut steps = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let r = std::panic::catch_unwind(|| ops::run_bytes(&data))
            .unwrap_or_else(|_| panic!("corpus input {} fails", f.display()));
        steps += r.steps;
    }
    assert!(steps > 1000, "the corpus runs only {steps} steps");
}
