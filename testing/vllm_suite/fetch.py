"""Take vLLM's tests from its source distribution and write the fake Hugging Face cache.

    python -m vllm_suite.fetch [--version 0.34.0] [--sdist PATH]

Without --sdist the sdist's address comes from the package index's simple JSON API; either
way its sha256 must equal the release's pin in `pins`. Only `tests/` and `pyproject.toml` are
extracted: never vLLM's own package source, so the installed vLLM is the one tested.
Standard library only, so that it runs before or without vLLM installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tarfile
import urllib.request
from pathlib import Path

from vllm_suite import hf_cache, pins

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_url(release: pins.Pin, index_url: str) -> str:
    """The sdist's download address, as the simple index (PEP 691 JSON) lists it."""
    request = urllib.request.Request(
        index_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        listing = json.load(response)
    for entry in listing["files"]:
        if entry["filename"] == release.sdist_name:
            listed = entry.get("hashes", {}).get("sha256")
            if listed is not None and listed != release.sdist_sha256:
                raise SystemExit(f"the index lists {release.sdist_name} with sha256 {listed}")
            return str(entry["url"])
    raise SystemExit(f"{release.sdist_name} is not listed at {index_url}")


def download(url: str, dest: Path) -> None:
    partial = dest.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=300) as response, partial.open("wb") as out:
        shutil.copyfileobj(response, out, _CHUNK)
    partial.replace(dest)


def obtain_sdist(release: pins.Pin, local: Path | None, index_url: str) -> Path:
    """A verified copy of the sdist: the given file, an earlier download, or a new one."""
    cached = release.work_dir / release.sdist_name
    if local is None and not cached.exists():
        release.work_dir.mkdir(parents=True, exist_ok=True)
        download(sdist_url(release, index_url), cached)
    path = local if local is not None else cached
    actual = sha256_of(path)
    if actual != release.sdist_sha256:
        if path == cached:
            path.unlink()  # the next run downloads it again
        raise SystemExit(f"{path}: sha256 {actual}, expected {release.sdist_sha256}")
    return path


def extract_tests(release: pins.Pin, sdist: Path, tree: Path) -> None:
    """Replace `tree` with the sdist's tests/ and pyproject.toml."""
    prefix = f"vllm-{release.version}/"
    wanted = (prefix + "tests/", prefix + "pyproject.toml")
    staging = tree.with_name(tree.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist, "r:gz") as archive:
        members = []
        for member in archive.getmembers():
            if member.name.startswith(wanted):
                member.name = member.name[len(prefix) :]
                members.append(member)
        # The "data" filter refuses absolute paths, links out of the folder and device files.
        archive.extractall(staging, members=members, filter="data")
    if not (staging / pins.SCHEDULER_TESTS).is_file():
        raise SystemExit(f"{sdist} holds no {pins.SCHEDULER_TESTS}")
    shutil.rmtree(tree, ignore_errors=True)
    staging.replace(tree)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_suite.fetch", description=__doc__)
    parser.add_argument(
        "--version", default=pins.DEFAULT_VERSION,
        help=f"the vLLM release (pinned: {', '.join(pins.SDIST_SHA256)})",
    )  # fmt: skip
    parser.add_argument("--sdist", type=Path, help="a local vllm-VERSION.tar.gz to use")
    parser.add_argument("--index-url", default=pins.SIMPLE_INDEX_URL)
    args = parser.parse_args(argv)
    release = pins.pin(args.version)
    sdist = obtain_sdist(release, args.sdist, args.index_url)
    extract_tests(release, sdist, release.tree_dir)
    hf_cache.write(release.hf_home)
    print(f"vLLM {release.version} tests in {release.tree_dir}, fake HF cache in {release.hf_home}")


if __name__ == "__main__":
    main()
