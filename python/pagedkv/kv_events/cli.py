"""`pagedkv events --connect ENDPOINT`: follow a KV-event stream, print one event a line
(its arguments are in `pagedkv.__main__`, which imports this only when asked)."""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

import zmq

from pagedkv.kv_events import wire
from pagedkv.kv_events.subscriber import Subscriber


def _hash(h: Any) -> str:
    return h.hex() if isinstance(h, bytes) else f"{h:#018x}"


def describe(e: Any) -> str:
    """One event as a line."""
    kind = type(e).__name__.lstrip("_").replace("Array", "")
    if kind == "Stored":
        parent = "-" if e.parent_block_hash is None else _hash(e.parent_block_hash)
        hashes = " ".join(_hash(h) for h in e.block_hashes)
        group = getattr(e, "group_idx", None) or 0
        return (
            f"BlockStored {e.medium} group={group} parent={parent} blocks={hashes} "
            f"tokens={len(e.token_ids)}"
        )
    if kind == "Removed":
        group = getattr(e, "group_idx", None) or 0
        return (
            f"BlockRemoved {e.medium} group={group} blocks={' '.join(map(_hash, e.block_hashes))}"
        )
    return "AllBlocksCleared"


class FollowError(Exception):
    """The stream cannot be followed: a bad endpoint (its message says why)."""


def follow(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Print the stream's events until `--count` batches or `--duration` seconds; 0 when
    anything arrived, 1 when nothing did (nobody publishing there, or another topic).
    Raises `FollowError` for an endpoint that cannot be connected."""
    batches = 0

    def show(seq: int, events: list[Any]) -> None:
        nonlocal batches
        batches += 1
        if not events:
            print(f"{seq} heartbeat", file=out)
        for e in events:
            print(f"{seq} {describe(e)}", file=out)
        out.flush()

    form: wire.EventForm = args.form
    try:
        sub = Subscriber(
            args.connect, args.replay, topic=args.topic, event_form=form, on_batch=show
        )
    except zmq.ZMQError as e:
        where = args.connect if args.replay is None else f"{args.connect} / {args.replay}"
        raise FollowError(f"cannot connect to {where}: {e}") from None
    print(f"following {args.connect} (Ctrl-C stops)", file=err)
    started = time.monotonic()
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    snapshots = 0
    try:
        while (args.count <= 0 or batches < args.count) and (
            deadline is None or time.monotonic() < deadline
        ):
            sub.poll(0.1)
            if sub.snapshots != snapshots:
                snapshots = sub.snapshots
                print(f"snapshot: {len(sub.blocks)} blocks, resuming at {sub.next_seq}", file=out)
    finally:
        sub.close()
    if batches == 0 and snapshots == 0:
        print(
            f"nothing received from {args.connect} in {time.monotonic() - started:.1f} s: is a "
            "publisher bound there, on this topic?",
            file=err,
        )
        return 1
    return 0


__all__ = ["FollowError", "describe", "follow"]
