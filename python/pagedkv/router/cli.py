"""`pagedkv router --connect ENDPOINT [--connect ...]`: follow engines' KV event streams into
one router index and print, every `--interval` seconds, each engine's blocks per medium
and its stream's counters, and the ranked engines for each request of `--lookup` (its
arguments are in `pagedkv.__main__`, which imports this only when asked)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, TextIO

import zmq

from pagedkv.router.follow import Follower
from pagedkv.router.index import RouterIndex


class RouterCliError(Exception):
    """A bad argument or endpoint (its message says why)."""


def _requests(path: Path | None) -> list[dict[str, Any]]:
    """`--lookup FILE`: JSON lines, each {"token_ids": [...]} (with an optional
    "cache_salt" and "lora_id") or {"block_hashes": [...]}."""
    if path is None:
        return []
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise RouterCliError(f"cannot read {path}: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise RouterCliError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(r, dict) or ("token_ids" in r) == ("block_hashes" in r):
            raise RouterCliError(f"{path}:{n}: give token_ids or block_hashes (exactly one)")
        out.append(r)
    return out


def _engines(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(engine id, PUB endpoint, replay endpoint or None) per --connect."""
    names = args.engine or []
    replays = args.replay or []
    if len(names) > len(args.connect) or len(replays) > len(args.connect):
        raise RouterCliError("more --engine or --replay than --connect")
    out = []
    for i, endpoint in enumerate(args.connect):
        name = names[i] if i < len(names) else endpoint
        out.append((name, endpoint, replays[i] if i < len(replays) else None))
    if len({n for n, _, _ in out}) != len(out):
        raise RouterCliError("two streams with the same engine id: name them with --engine")
    return out


def _report(ix: RouterIndex, followers: dict[str, Follower], out: TextIO) -> None:
    print(f"-- {time.strftime('%H:%M:%S')}  {ix.stats().memberships} blocks held", file=out)
    for name, f in followers.items():
        held = " ".join(
            f"{m or '-'}{'' if not g else f'/g{g}'}={n}" for m, g, n in ix.holder_sizes(name)
        )
        print(
            f"{name}  {held or 'no blocks'}  batches={f.batches} gaps={f.gaps} "
            f"replays={f.replays} snapshots={f.snapshots} lost={f.lost} restarts={f.restarts}",
            file=out,
        )


def _lookups(ix: RouterIndex, requests: list[dict[str, Any]], out: TextIO) -> None:
    for i, r in enumerate(requests):
        ranked = ix.match(
            r.get("block_hashes"),
            token_ids=r.get("token_ids"),
            cache_salt=r.get("cache_salt"),
            lora_id=r.get("lora_id"),
        )
        best = ", ".join(f"{m.engine_id} {m.blocks}" for m in ranked) or "no engine holds any"
        print(f"lookup {i}: {best}", file=out)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Follow until `--count` reports or `--duration` seconds; 0 when anything arrived, 1
    when nothing did. Raises `RouterCliError` for a bad argument or endpoint."""
    requests = _requests(args.lookup)
    ix = RouterIndex(
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
        hash_form=args.hash_form,
    )
    followers: dict[str, Follower] = {}
    try:
        for name, endpoint, replay in _engines(args):
            try:
                followers[name] = ix.follow(name, endpoint, replay, topic=args.topic)
            except zmq.ZMQError as e:
                where = endpoint if replay is None else f"{endpoint} / {replay}"
                raise RouterCliError(f"cannot connect to {where}: {e}") from None
        print(f"following {len(followers)} engine(s) (Ctrl-C stops)", file=err)
        started = time.monotonic()
        deadline = started + args.duration if args.duration > 0 else None
        reports = 0
        while args.count <= 0 or reports < args.count:
            wait = args.interval
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait > 0:
                time.sleep(wait)
            _report(ix, followers, out)
            _lookups(ix, requests, out)
            out.flush()
            reports += 1
            if deadline is not None and time.monotonic() >= deadline:
                break
        if not any(f.batches or f.snapshots for f in followers.values()):
            print(
                f"nothing received in {time.monotonic() - started:.1f} s: is a publisher "
                "bound there, on this topic?",
                file=err,
            )
            return 1
        return 0
    finally:
        ix.close()


__all__ = ["RouterCliError", "run"]
