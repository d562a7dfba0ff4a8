"""`simulate --mrc` from start to end: the curve runs and the check runs, in parallel processes.

Every configured run records a curve (one task each); once a block size's curve runs are in,
its search (`sizing.Search`) proposes check runs, a round at a time, and each becomes a task.
One replay for every block size: when the pool sizes were not given (no `--num-blocks`, no
`--cache-tokens`: the default pool, the same block count at every block size), only the
smallest block size's configured run is replayed, with one recorder per block size (`FanOut`),
and the other block sizes' configured runs are not run at all (the output and `--json`'s
`sizing.not_run` say so). Their curves differ from their own replays' by little: the order of
block touches depends on the block size only through the schedule (on the 12,031-request
conversation trace, B=32's estimate from the B=16 replay was 608,230 blocks, from its own
608,232), and the check runs that decide the answer are full runs at each block size anyway.
`--jobs N` processes take the tasks (default: one per core; `--jobs 1` runs them here, one
after another). Workers are started with `spawn`, so each imports the Rust extension afresh,
reads the workload itself and ignores Ctrl-C: the parent stops them (and they die with it).
The answer is the same for any N: a search's next round depends only on its own results.

What is known is never lost: `--json` is rewritten (atomically) after every finished run,
with `sizing.status` saying how far it got; Ctrl-C (or SIGTERM) stops the runs, prints what is
known, writes it and exits with 130; a curve run stopped midway hands back the curve of the
requests it replayed, shown as partial (`sim.sizing_partial`). Progress goes to stderr
(`progress.RunLines`). The last line gives the wall time and the CPU time of this process and
its workers together.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.check_bound import StopRule
from pagedkv.sim.fan_out import FanOut
from pagedkv.sim.kv_bytes import KVBytes, kv_bytes
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.mrc_fast import FastMRCRecorder
from pagedkv.sim.progress import ProgressBar, RunLines, clock
from pagedkv.sim.report import json_doc, summary_table, sweep_table, write_doc
from pagedkv.sim.requests import Workload
from pagedkv.sim.runner import (
    INTERRUPTED,
    Runner,
    clock_now,
    read_workload,
    schedule_options,
    stop_on_sigterm,
)
from pagedkv.sim.sizing import ROUND, Recommendation, Search, Trial
from pagedkv.sim.sizing_cli import DEFAULT_TARGET_FRACTION, recorder, target_for
from pagedkv.sim.sizing_fidelity import compare, fidelity_line
from pagedkv.sim.sizing_partial import PARTIAL_WAIT, CurveInterrupted, PartialCurve
from pagedkv.sim.sizing_report import (
    CURVE_RUN_HEADING,
    curve_json,
    mrc_table,
    recommendation_json,
    recommendation_lines,
    table_sizes,
)

REPORT_EVERY = 1.0  # seconds between a worker's progress messages


@dataclass(frozen=True, slots=True)
class Task:
    """One run: a configured run that records a curve, or a check run at one size."""

    label: str
    kind: str  # "curve" or "check"
    config: BlockManagerConfig
    target: float = 0.0
    index: int = 0  # a curve run: which configured run
    sample_rate: float = 1.0  # a curve run: the curve's (decided here, by `recorder`)
    # A curve run: other block sizes whose curves this replay records too, with their rates.
    others: tuple[tuple[int, float], ...] = ()


Report = Callable[[str, int, int], None]  # (label, finished requests, requests)


# ---------------------------------------------------------------------- the work itself


@dataclass(slots=True)
class _Context:
    """What a process needs to run tasks: the options and the workload."""

    args: argparse.Namespace
    workload: Workload
    kv: KVBytes | None


class _Bar(ProgressBar):
    """`runner.Runner`'s progress bar, reporting instead of drawing."""

    def __init__(self, label: str, report: Report) -> None:
        super().__init__(label, stream=io.StringIO())
        self.report = report

    def __call__(self, done: int, total: int) -> None:
        self.report(self.label, done, total)

    def close(self) -> None:
        pass


def perform(task: Task, ctx: _Context, report: Report) -> dict[str, Any]:
    """Run one task; `{"figures", "curve", "others"}` for a curve run (`others`: block size
    -> curve, of `task.others`), `{"trial"}` for a check run."""
    from pagedkv.sim.factory import make_manager
    from pagedkv.sim.scheduler import run_workload

    args, config = ctx.args, task.config
    if task.kind == "curve":
        seen = [0, len(ctx.workload.requests)]  # requests ended, requests: for Ctrl-C

        def counted(label: str, done: int, total: int) -> None:
            seen[:] = [done, total]
            report(label, done, total)

        runner = Runner(args, ctx.workload, ctx.kv, lambda label: _Bar(label, counted))
        own = FastMRCRecorder(config.block_size, task.sample_rate)
        others = [(bs, FastMRCRecorder(bs, rate)) for bs, rate in task.others]
        watch = FanOut([own, *(r for _, r in others)]) if others else own
        try:
            f = runner(config, task.label, watch)
        except KeyboardInterrupt:
            part = PartialCurve(
                task.index,
                config.block_size,
                own.curve(),
                seen[0],
                seen[1],
                {bs: r.curve() for bs, r in others},
            )
            raise CurveInterrupted(part) from None
        return {"figures": f, "curve": own.curve(), "others": {bs: r.curve() for bs, r in others}}
    rule = StopRule.build(ctx.workload, config.block_size, task.target, args.abort_rate > 0)
    manager = make_manager(config, reference=args.reference)
    res = run_workload(
        manager,
        ctx.workload,
        **schedule_options(args),
        check=args.check,
        progress=lambda done, total: report(task.label, done, total),
        until=rule,
        loop=getattr(args, "loop", "auto"),
    )
    if args.check:
        manager.check_invariants()
    stopped = ""
    if res.stopped_early:
        stopped = f"{rule.reason} after {res.finished_requests}/{res.requests} requests"
    trial = Trial(
        config.num_blocks,
        res.workload_hit_rate,
        res.preemptions,
        res.rejected_requests,
        task.target,
        stopped=stopped,
    )
    return {"trial": trial}


# ---------------------------------------------------------------------- worker processes

_WORKER: dict[str, Any] = {}


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _init_worker(args: argparse.Namespace, messages: Any, stop: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    _die_with_parent()
    _WORKER["args"] = args
    _WORKER["messages"] = messages
    _WORKER["stop"] = stop  # set by the parent after Ctrl-C: hand back what was replayed


def _worker_context() -> _Context:
    ctx = _WORKER.get("ctx")
    if ctx is None:
        args = _WORKER["args"]
        workload = read_workload(args, io.StringIO())
        ctx = _Context(args, workload, kv_bytes(args.model, args.kv_bytes_per_token))
        _WORKER["ctx"] = ctx
    assert isinstance(ctx, _Context)
    return ctx


def _work(task: Task) -> dict[str, Any]:
    """A task in a worker process; progress goes to the parent through the queue."""
    messages = _WORKER["messages"]
    messages.put(("start", task.label, 0, 0))
    last = [0.0]

    stop = _WORKER["stop"]
    checked = [0.0]

    def report(label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - checked[0] >= 0.05:  # the parent's Ctrl-C, seen within 50 ms
            checked[0] = now
            if stop.is_set():
                raise KeyboardInterrupt
        if now - last[0] >= REPORT_EVERY:
            last[0] = now
            messages.put(("update", label, done, total))

    try:
        return perform(task, _worker_context(), report)
    except CurveInterrupted as exc:
        return {"partial": exc.partial}
    except KeyboardInterrupt:  # a check run: nothing of it is worth keeping
        return {"stopped": True}


class _Serial:
    """`--jobs 1`: each task runs here, when submitted."""

    def __init__(self, ctx: _Context, lines: RunLines | None) -> None:
        self.ctx = ctx
        self.lines = lines

    def submit(self, task: Task) -> cf.Future[dict[str, Any]]:
        fut: cf.Future[dict[str, Any]] = cf.Future()
        if self.lines is not None:
            self.lines.start(task.label)
        report = self.lines.update if self.lines is not None else (lambda *_: None)
        try:
            fut.set_result(perform(task, self.ctx, report))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def stop(self) -> None:
        pass


class _Pool:
    """`--jobs N`: a process pool, its progress queue, and a hard stop."""

    def __init__(self, args: argparse.Namespace, workers: int) -> None:
        context = mp.get_context("spawn")
        self.messages = context.Queue()
        self.stopping = context.Event()
        self.pool = cf.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=_init_worker,
            initargs=(args, self.messages, self.stopping),
        )

    def submit(self, task: Task) -> cf.Future[dict[str, Any]]:
        return self.pool.submit(_work, task)

    def drain(self, lines: RunLines | None) -> None:
        while True:
            try:
                kind, label, done, total = self.messages.get_nowait()
            except queue.Empty:
                return
            if lines is None:
                continue
            if kind == "start":
                lines.start(label)
            else:
                lines.update(label, done, total)

    def collect(self, pending: dict[cf.Future[dict[str, Any]], Task], wait: float) -> None:
        """After Ctrl-C: ask the workers to stop and hand back what their curve runs
        replayed, and wait up to `wait` seconds for the curve runs among `pending`."""
        self.stopping.set()
        curves = [f for f, t in pending.items() if t.kind == "curve"]
        if curves:
            cf.wait(curves, timeout=wait)

    def stop(self) -> None:
        """End the workers now (Ctrl-C), then the pool."""
        for p in list(self.pool._processes.values()):
            p.terminate()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.messages.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.messages.close()


# ---------------------------------------------------------------------- the driver


class Sizing:
    """The state of a sizing run: finished runs, curves, searches; prints and saves it."""

    def __init__(
        self,
        args: argparse.Namespace,
        configs: list[BlockManagerConfig],
        workload: Workload,
        kv: KVBytes | None,
        out: TextIO,
        err: TextIO,
        started: tuple[float, float] | None = None,
    ) -> None:
        self.args = args
        self.configs = configs
        self.workload = workload
        self.kv = kv
        self.out = out
        self.err = err
        self.jobs = args.jobs or os.cpu_count() or 1
        self.checks = not args.mrc_only
        self.two_sided = bool(args.bracket)
        # One replay for every block size (the module docstring): `shared` is the configured
        # run that records every block size's curve, `skipped` the runs left out for it.
        self.shared: int | None = None
        self.skipped: set[int] = set()
        sizes = sorted({c.block_size for c in configs})
        if args.num_blocks is None and args.cache_tokens is None and len(sizes) > 1:
            mine = [j for j, c in enumerate(configs) if c.block_size == sizes[0]]
            self.shared = max(mine, key=lambda j: configs[j].num_blocks)
            self.skipped = {j for j, c in enumerate(configs) if c.block_size != sizes[0]}
        self.replays = 0  # curve runs finished
        self.preempted = 0  # the shared replay's preemptions, when it had any (`_fall_back`)
        self.shared_curves: dict[int, dict[str, Any]] = {}  # block size -> its curve's JSON
        self.lines = None if args.no_progress else RunLines(err, tty=err.isatty())
        self.figures: list[dict[str, Any] | None] = [None] * len(configs)
        self.run_curves: dict[int, MissRatioCurve] = {}  # configured run -> its curve
        self.curves: dict[int, MissRatioCurve] = {}  # block size -> its curve (most blocks)
        self.searches: dict[int, Search] = {}
        self.status = "curve runs"
        self.t0, self.cpu0 = started or clock_now()
        self.partials: list[PartialCurve] = []  # curve runs stopped by Ctrl-C, what they saw
        self.printed_curves = False
        self.fidelity: dict[int, dict[str, Any]] = {}  # block size -> `sizing_fidelity.compare`

    # ------------------------------------------------------------------ what is known

    def _not_run_note(self, config: BlockManagerConfig) -> str:
        """Why a configured run of a block size was not run (one replay for every size)."""
        assert self.shared is not None
        by = self.configs[self.shared].block_size
        bs = config.block_size
        which = f"B={bs}"
        if sum(c.block_size == bs for c in self.configs) > 1:
            which += f" ({config.num_blocks} blocks, {config.hash_algo})"
        return (
            f"{which}: no run of its own; its curve comes from the B={by} run's replay, in "
            f"blocks of {bs} (a replay of its own would differ only by hit granularity and "
            "pool pressure); give --num-blocks or --cache-tokens to run each block size"
        )

    def replay_json(self) -> dict[str, Any]:
        """`sizing`'s account of the curve replays: how many, and what was not run."""
        shared = None
        if self.shared is not None:
            c = self.configs[self.shared]
            shared = {
                "block_size": c.block_size,
                "num_blocks": c.num_blocks,
                "hash_algo": c.hash_algo,
                "curves_of_block_sizes": sorted(
                    {c.block_size, *(self.configs[j].block_size for j in self.skipped)}
                ),
                # When it preempted, the other block sizes were replayed on their own.
                "preemptions": self.preempted,
            }
        return {
            "curve_replays": self.replays,
            "shared_replay": shared,
            "not_run": [
                {
                    "block_size": c.block_size,
                    "num_blocks": c.num_blocks,
                    "hash_algo": c.hash_algo,
                    "why": self._not_run_note(c),
                }
                for j, c in enumerate(self.configs)
                if j in self.skipped
            ],
            "curves": [self.shared_curves[bs] for bs in sorted(self.shared_curves)],
        }

    def recommendations(self) -> list[Recommendation]:
        done = self.status == "complete"
        return [
            s.result(checked=self.checks, complete=done or not self.checks)
            for _, s in sorted(self.searches.items())
        ]

    def sizing_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "checked": self.checks,
            "search": "bracket" if self.two_sided else "one-sided",
            "target_hit_rate": self.args.target_hit_rate,
            "default_target_fraction": DEFAULT_TARGET_FRACTION,
            "recommendations": [recommendation_json(r, self.kv) for r in self.recommendations()],
            **self.replay_json(),
            "fidelity": [self.fidelity[bs] for bs in sorted(self.fidelity)],
            "jobs": self.jobs,
            "wall_s": time.perf_counter() - self.t0,
            "partial_curves": [p.as_json() for p in self.partials],
        }

    def save(self) -> None:
        """Rewrite --json with what is known now."""
        if not self.args.json:
            return
        runs = [f for f in self.figures if f is not None]
        doc = json_doc(runs, extra={"sizing": self.sizing_json()}, sweep=len(self.configs) > 1)
        write_doc(self.args.json, doc)

    # ------------------------------------------------------------------ the steps

    def _replays_done(self) -> bool:
        return all(f is not None for j, f in enumerate(self.figures) if j not in self.skipped)

    def _curve_done(self, i: int, result: dict[str, Any]) -> None:
        config = self.configs[i]
        curve: MissRatioCurve = result["curve"]
        result["figures"].update(curve_json(curve))
        self.figures[i] = result["figures"]
        self.run_curves[i] = curve
        self.replays += 1
        for other, shared in sorted(result["others"].items()):
            # A block size with no run of its own: its curve is this replay's.
            target, note = target_for(self.args, shared)
            sizes = table_sizes(shared, self.args.mrc_points, (target,))
            per_block = self.kv.per_block(other) if self.kv else None
            self.shared_curves[other] = {
                "block_size": other,
                "from_replay_block_size": config.block_size,
                "bytes_per_block": per_block,
                **curve_json(shared, sizes),
            }
            self.curves[other] = shared
            self.searches[other] = Search(shared, target, target_note=note, bracket=self.two_sided)
        bs = config.block_size
        mine = [j for j, c in enumerate(self.configs) if c.block_size == bs]
        if any(self.figures[j] is None for j in mine):
            return
        # Every run of this block size is in: the one with the most blocks gives the curve.
        best = max(mine, key=lambda j: self.configs[j].num_blocks)
        best_curve = self.run_curves[best]
        target, note = target_for(self.args, best_curve)
        sizes = table_sizes(best_curve, self.args.mrc_points, (target,))
        self.figures[best].update(curve_json(best_curve, sizes))  # type: ignore[union-attr]
        known = []
        for j in mine:
            f = self.figures[j]
            assert f is not None
            known.append(
                Trial(
                    f["num_blocks"],
                    f["workload_hit_rate"],
                    f["preemptions"],
                    f["rejected_requests"],
                    target,
                    source="curve",
                )
            )
        self.curves[bs] = best_curve
        self.searches[bs] = Search(
            best_curve, target, target_note=note, known=tuple(known), bracket=self.two_sided
        )

    def _summary(self) -> None:
        runs = [f for f in self.figures if f is not None]
        print(file=self.out)
        print(CURVE_RUN_HEADING, file=self.out)
        print(summary_table(runs[0]) if len(runs) == 1 else sweep_table(runs), file=self.out)
        for j in sorted(self.skipped):
            print(f"not run     {self._not_run_note(self.configs[j])}", file=self.out)
        if self.args.check:
            print(
                "invariants  OK (checked after every step; no prefix hit on unscheduled tokens)",
                file=self.out,
            )

    def _print_curves(self) -> None:
        if self.printed_curves:
            return
        self.printed_curves = True
        for bs, curve in sorted(self.curves.items()):
            print(file=self.out)
            target = self.searches[bs].target
            shared = self.shared_curves.get(bs)
            source = f"from the B={shared['from_replay_block_size']} replay" if shared else ""
            table = mrc_table(
                curve, self.kv, rows=self.args.mrc_points, targets=(target,), source=source
            )
            print(table, file=self.out)
            sizes = table_sizes(curve, self.args.mrc_points, (target,))
            f = compare(curve, self.workload, sizes)
            if f is not None:
                self.fidelity[bs] = f
                print(fidelity_line(f), file=self.out)
        self.out.flush()

    def _submit_round(self, bs: int, submit: Callable[[Task], None]) -> None:
        search = self.searches[bs]
        config = max((c for c in self.configs if c.block_size == bs), key=lambda c: c.num_blocks)
        sizes = search.next_round()
        if not sizes and self.lines is not None and search.estimate is not None:
            lo, hi = search.bracket()
            found = f"{hi} blocks passed" if hi is not None else "no size passed"
            below = {
                "bracketed": f", {lo} failed below it",
                "one-sided": " (one-sided: no size just below it run)",
                "out of runs": " (the runs ran out before a size just below it failed)",
            }.get(search.result().ended, "")
            self.lines.note(f"B={bs}: check runs done: {found}{below}")
        for n in sizes:
            sized = BlockManagerConfig(
                num_blocks=n,
                block_size=bs,
                num_cpu_blocks=config.num_cpu_blocks,
                hash_algo=config.hash_algo,
                watermark=config.watermark,
            )
            submit(Task(f"B={bs} check run at {n} blocks", "check", sized, search.target))

    def run(self) -> int:
        """Everything, then the answer; returns the exit status."""
        pending: dict[cf.Future[dict[str, Any]], Task] = {}
        tasks = len(self.configs) + ROUND * len({c.block_size for c in self.configs})
        parallel = self.jobs > 1
        executor: _Pool | _Serial = (
            _Pool(self.args, min(self.jobs, tasks))
            if parallel
            else _Serial(_Context(self.args, self.workload, self.kv), self.lines)
        )
        lines = self.lines

        def submit(task: Task) -> None:
            pending[executor.submit(task)] = task

        previous = stop_on_sigterm()
        try:
            for i in range(len(self.configs)):
                if i not in self.skipped:
                    submit(self._curve_task(i))
            while pending:
                if isinstance(executor, _Pool):
                    done, _ = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                    executor.drain(lines)
                else:
                    done = set(pending)
                for fut in sorted(done, key=lambda f: pending[f].label):
                    task = pending.pop(fut)
                    result = fut.result()
                    self._finished(task, result, submit)
            self.status = "complete"
            if isinstance(executor, _Pool):
                executor.close()
        except KeyboardInterrupt as exc:
            print(
                "interrupted (Ctrl-C): stopping the runs; what is known follows",
                file=self.err,
                flush=True,
            )
            if isinstance(exc, CurveInterrupted):
                self.partials.append(exc.partial)
            if isinstance(executor, _Pool):
                with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: no waiting
                    executor.collect(pending, PARTIAL_WAIT)
            executor.stop()
            # Runs that finished but were not taken in yet still count.
            for fut, task in sorted(pending.items(), key=lambda item: item[1].label):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    result = fut.result()
                    if "partial" in result:
                        self.partials.append(result["partial"])
                    elif "stopped" not in result:
                        self._finished(task, result, lambda _: None)
            self._interrupted()
            return INTERRUPTED
        except BaseException:
            executor.stop()
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if lines is not None:
                lines.close()
        self._answer()
        return 0

    def _curve_task(self, i: int) -> Task:
        """The curve run of configured run `i` (with the other block sizes' recorders when it
        is the shared replay)."""
        c = self.configs[i]
        label = f"B={c.block_size} curve run"
        if len(self.configs) > len({c.block_size for c in self.configs}):
            label += f" ({c.num_blocks} blocks, {c.hash_algo})"
        extra: tuple[tuple[int, float], ...] = ()
        if i == self.shared and self.skipped:
            others = sorted({self.configs[j].block_size for j in self.skipped})
            extra = tuple((bs, recorder(self.args, self.workload, bs).sample_rate) for bs in others)
            label += f" (and the curve of B={', '.join(map(str, others))})"
        rate = recorder(self.args, self.workload, c.block_size).sample_rate
        return Task(label, "curve", c, index=i, sample_rate=rate, others=extra)

    def _fall_back(self, result: dict[str, Any], submit: Callable[[Task], None]) -> None:
        """The shared replay preempted: its schedule is no guide to the other block sizes'
        (a pool under pressure shapes the curve: recomputed prompts are touched again), so
        they get their own replays after all, as with explicit sizes."""
        self.preempted = result["figures"]["preemptions"]
        result["others"] = {}
        again = sorted(self.skipped)
        self.skipped = set()
        for j in again:
            submit(self._curve_task(j))
        if self.lines is not None:
            by = self.configs[self.shared or 0].block_size
            self.lines.note(
                f"B={by}'s replay preempted {self.preempted} times: every block size is "
                "replayed on its own"
            )

    def _finished(self, task: Task, result: dict[str, Any], submit: Callable[[Task], None]) -> None:
        lines = self.lines
        if task.kind == "curve":
            i = task.index
            if lines is not None:
                f = result["figures"]
                lines.end(task.label, f"done, hit rate {f['workload_hit_rate']:.2%}")
            if result["others"] and result["figures"]["preemptions"]:
                self._fall_back(result, submit)
            before = set(self.searches)
            self._curve_done(i, result)
            if self._replays_done():
                self.status = "check runs" if self.checks else "complete"
            for bs in sorted(set(self.searches) - before):
                if self.checks:
                    if lines is not None:
                        s = self.searches[bs]
                        where = (
                            "no size on the curve reaches it"
                            if s.estimate is None
                            else f"the curve's estimate {s.estimate} blocks; check runs"
                        )
                        lines.note(f"B={bs}: target {s.target:.2%}, {where}")
                    self._submit_round(bs, submit)
        else:
            trial: Trial = result["trial"]
            bs = task.config.block_size
            search = self.searches[bs]
            search.record(trial)
            if lines is not None:
                lines.end(task.label, "passed" if trial.passed else f"failed ({trial.why()})")
            if not search.pending:
                self._submit_round(bs, submit)
        self.save()

    def _time_line(self) -> str:
        wall = time.perf_counter() - self.t0
        cpu = clock_now()[1] - self.cpu0
        where = f"{self.jobs} processes" if self.jobs > 1 else "in this process"
        return (
            f"time        wall {wall:.1f} s ({clock(wall)}), CPU {cpu:.1f} s ({clock(cpu)}): "
            f"user + sys of this process and its workers (--jobs {self.jobs}: {where})"
        )

    def _answer(self) -> None:
        # The answer first, then the curves, then the replay's own figures at its own size.
        print(file=self.out)
        print(recommendation_lines(self.recommendations(), self.kv), file=self.out)
        self._print_curves()
        self._summary()
        self.save()
        if self.args.json:
            print(f"json        {self.args.json}", file=self.out)
        if self.args.plot:
            from pagedkv.sim.plot import plot_runs

            runs = [f for f in self.figures if f is not None]
            plot_runs(self.args.plot, runs, sizing=self.sizing_json())
            print(f"plot        {self.args.plot}", file=self.out)
        print(self._time_line(), file=self.out)

    def _interrupted(self) -> None:
        self.status = "interrupted"
        print(file=self.out)
        print("interrupted (Ctrl-C): the runs were stopped; what was known follows", file=self.out)
        if self.curves:
            print(file=self.out)
            print(recommendation_lines(self.recommendations(), self.kv), file=self.out)
            self._print_curves()
        for p in self.partials:
            print(file=self.out)
            print(f"partial     {p.describe()}", file=self.out)
            print(mrc_table(p.curve, self.kv, rows=self.args.mrc_points), file=self.out)
        if any(f is not None for f in self.figures):
            self._summary()
        try:
            self.save()
            if self.args.json:
                print(f"json        {self.args.json} (what was known)", file=self.out)
        except OSError as exc:
            print(f"json        not written: {exc}", file=self.out)
        print(self._time_line(), file=self.out)
        self.out.flush()


def size(
    args: argparse.Namespace,
    configs: list[BlockManagerConfig],
    workload: Workload,
    kv: KVBytes | None,
    out: TextIO,
    err: TextIO,
    *,
    started: tuple[float, float] | None = None,
) -> int:
    """`simulate --mrc` after the header lines: the runs, the curves, the answer. `started`:
    `clock_now()` when the command began (the time line counts from there)."""
    from pagedkv.sim.sizing_blocks import replay_kind, size_from_ids

    if replay_kind(args, configs, workload) == "cache":
        return size_from_ids(args, configs, workload, kv, out, started or clock_now())
    return Sizing(args, configs, workload, kv, out, err, started).run()


__all__ = ["INTERRUPTED", "Sizing", "Task", "clock_now", "perform", "size"]
