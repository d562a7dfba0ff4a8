"""Throughput of the remote tier on a local server: put and get of N entries of S bytes,
through `RemoteTier` and, for comparison, plain redis-py SET/GET of the same bytes and the
entry framing alone (HMAC-SHA256 both ways). Starts its own redis-server (or
valkey-server) on loopback TCP and on a unix socket, one thread.

    PYTHONPATH=python python benches/remote_throughput.py [--size 1048576] [--n 256]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from pagedkv.tiers import Namespace, TierKey, decode_entry, encode_entry
from pagedkv.tiers.remote import RemoteTier
from redis_fixtures import ServerProcess, server_binary


def best(repeat: int, fn: Callable[[], object]) -> float:
    """The shortest of `repeat` runs of `fn`, in seconds (the machine may be shared)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.2f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--server", choices=["redis", "valkey"], default="redis")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = ap.parse_args()
    ns = Namespace("bench", "layout", "float16", 16)
    secret = os.urandom(32)
    keys = [TierKey(0, hashlib.blake2b(b"%d" % i, digest_size=32).digest()) for i in range(args.n)]
    data = [os.urandom(args.size) for _ in range(min(args.n, 16))]
    total = args.n * args.size

    r = args.repeat
    entries = [
        encode_entry(ns.ident(), 0, k.digest, 0, 1, args.size, data[i % len(data)], secret=secret)
        for i, k in enumerate(keys)
    ]

    def encode_all() -> None:
        for i, k in enumerate(keys):
            encode_entry(
                ns.ident(), 0, k.digest, 0, 1, args.size, data[i % len(data)], secret=secret
            )

    def check_all() -> None:
        for k, e in zip(keys, entries, strict=True):
            decode_entry(e, ns.ident(), 0, k.digest, secret=secret)

    t_enc, t_dec = best(r, encode_all), best(r, check_all)
    parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python"
    print(f"{args.n} x {args.size} B entries, redis-py {redis.__version__} ({parser} parser); "
          f"framing alone: encode {rate(total, t_enc)}, check {rate(total, t_dec)}")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp, "redis.sock")
        server = ServerProcess(
            server_binary(args.server), Path(tmp), args=["--unixsocket", str(sock)]
        )
        server.start()
        try:
            for transport, url in (("tcp", server.url), ("unix", f"unix://{sock}")):
                plain = redis.Redis.from_url(url)
                plain.flushall()

                def set_all(plain: redis.Redis = plain) -> None:
                    for i in range(len(keys)):
                        plain.set(b"plain:%d" % i, data[i % len(data)])

                def get_all(plain: redis.Redis = plain) -> None:
                    for i in range(len(keys)):
                        plain.get(b"plain:%d" % i)

                t_set, t_get = best(r, set_all), best(r, get_all)
                plain.flushall()

                tier = RemoteTier(url, ns, secret=secret, timeout=5.0)

                def put_all(tier: RemoteTier = tier) -> None:
                    for i, k in enumerate(keys):
                        assert tier.put(k, data[i % len(data)])

                def tget_all(tier: RemoteTier = tier) -> None:
                    for k in keys:
                        assert tier.get(k) is not None

                def lookup(tier: RemoteTier = tier) -> None:
                    assert tier.count_present(keys) == len(keys)

                t_put, t_tget, t_cp = best(r, put_all), best(r, tget_all), best(r, lookup)
                print(
                    f"{args.server} {transport:4}: RemoteTier put {rate(total, t_put)}, "
                    f"get {rate(total, t_tget)}; redis-py (its defaults) SET {rate(total, t_set)}, "
                    f"GET {rate(total, t_get)}; count_present({len(keys)}) "
                    f"{t_cp * 1e3:.2f} ms"
                )
                plain.flushall()
                plain.close()
                tier.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
