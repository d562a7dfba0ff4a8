"""A fake Hugging Face cache holding only the model files vLLM's scheduler tests read.

The layout is the hub library's: `hub/models--ORG--NAME/refs/main` names a revision and
`snapshots/REVISION/` holds the files. With HF_HUB_OFFLINE=1 the hub library resolves a model
id to that snapshot without the network. The revision is made up (a hash of the files), so
it cannot be mistaken for a real commit of the model's repository.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from vllm_suite import pins


def _revision(files: list[Path]) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def write(hf_home: Path) -> None:
    """Replace the hub folder of `hf_home` with one snapshot per folder of hf_configs/."""
    hub = hf_home / "hub"
    shutil.rmtree(hub, ignore_errors=True)
    for source in sorted(p for p in pins.HF_CONFIGS.iterdir() if p.is_dir()):
        files = sorted(source.glob("*.json"))
        revision = _revision(files)
        repo = hub / f"models--{source.name}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for path in files:
            shutil.copyfile(path, snapshot / path.name)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision)
