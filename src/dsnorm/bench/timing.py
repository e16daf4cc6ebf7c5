"""Timing: the repetition policy (:class:`Settings`), medians of single calls timed interleaved
(:func:`measure`), the same watched for other work on the CPUs and timed again while there was
some (:func:`measure_uncontended`; :func:`settle` waits for it to stop before a run), CUDA-graph
replays (:func:`graph_replay_time`) and the machine's copy bandwidth (:func:`copy_bandwidth`)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from dsnorm import contention
from dsnorm.bench.providers import Runner

# A row whose median exceeds this many times its fastest call is flagged as noisy.
NOISY_RATIO = 3.0


@dataclass
class Settings:
    """Repetition policy: each provider gets about ``budget_s`` of timed calls per case, between
    ``min_reps`` and ``max_reps`` calls, split over ``rounds`` interleaved rounds; a case timed
    while other work shared the CPUs is timed again, ``attempts`` times in all at most."""

    budget_s: float
    min_reps: int
    max_reps: int
    warmup: int
    rounds: int
    copy_mb: int
    copy_reps: int
    attempts: int = 3


DEFAULT = Settings(budget_s=0.25, min_reps=3, max_reps=2000, warmup=2, rounds=5, copy_mb=256, copy_reps=10)
QUICK = Settings(budget_s=0.01, min_reps=2, max_reps=50, warmup=2, rounds=2, copy_mb=64, copy_reps=3)


class _Clock:
    """Per-call wall time; on CUDA, events around each call, read after a synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def call(self, fn, args):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            return (start, end)
        t0 = time.perf_counter_ns()
        fn(*args)
        return (time.perf_counter_ns() - t0) * 1e-9

    def resolve(self, stamps: list) -> list:
        if not self.cuda:
            return stamps
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in stamps]


def measure(runners: list, settings: Settings, device: torch.device, failures: Optional[dict] = None) -> dict:
    """Median seconds per call for each runner, timed interleaved.

    Warm-up calls first (they absorb first-call compilation and allocation; the fastest of them
    estimates the cost of one call, so that one call stalled by another process does not cut the
    timed calls to the minimum); each runner is then given ``n`` calls (``budget_s / estimate``, clamped to
    ``[min_reps, max_reps]``) spread over ``rounds`` round-robin rounds whose starting provider
    rotates; a round stops a runner early (after at least one call) once it has spent twice its
    share of the budget. Returns ``{name: (median_s, n, min_s)}``. With a ``failures`` dict, a
    runner that raises is dropped from the timing and its error recorded there by name (else the
    error propagates).
    """
    clock = _Clock(device)
    reps = {}
    live = []

    def failed(r, e) -> bool:
        if failures is None:
            return False
        failures[r.name] = f"raised while timed: {type(e).__name__}: {str(e)[:100]}"
        return True

    for r in runners:
        est = math.inf
        try:
            for _ in range(max(1, settings.warmup)):
                args = r.args()
                est = min(est, clock.resolve([clock.call(r.fn, args)])[0])
        except Exception as e:
            if failed(r, e):
                continue
            raise
        wanted = math.ceil(settings.budget_s / max(est, 1e-7))
        reps[r.name] = int(min(settings.max_reps, max(settings.min_reps, wanted)))
        live.append(r)
    times = {r.name: [] for r in live}
    rounds = settings.rounds
    for rd in range(rounds):
        start = rd % len(live) if live else 0
        for r in live[start:] + live[:start]:
            n = reps[r.name] // rounds + (1 if rd < reps[r.name] % rounds else 0)
            # The call count comes from the warm-up estimate; should the provider turn slow later
            # (a stall when another process takes a core), the round's share of the budget caps it.
            deadline = time.perf_counter() + 2 * settings.budget_s / rounds
            stamps = []
            try:
                for k in range(n):
                    if k and time.perf_counter() > deadline:
                        break
                    args = r.args()
                    stamps.append(clock.call(r.fn, args))
                times[r.name].extend(clock.resolve(stamps))
            except Exception as e:
                if not failed(r, e):
                    raise
                del times[r.name]
        live = [r for r in live if r.name in times]  # a runner that raised is timed no more
    return {name: (statistics.median(ts), len(ts), min(ts)) for name, ts in times.items()}


def measure_uncontended(runners: list, settings: Settings, device: torch.device, meter: contention.Meter,
                        failures: Optional[dict] = None) -> tuple:
    """:func:`measure`, watched by ``meter``: a window found contended (:func:`dsnorm.contention.judge`)
    is measured again, ``settings.attempts`` times in all at most. Returns ``(medians, contention)``:
    the first uncontended attempt's medians, else the least contended attempt's (lowest
    ``others_cpus``), and that window's judgement with ``attempts`` (how many were made) added.
    A runner that raises is dropped from later attempts (``failures`` names it)."""
    best = None
    for attempt in range(1, max(1, settings.attempts) + 1):
        token = meter.start()
        medians = measure(runners, settings, device, failures)
        window = meter.stop(token)
        if best is None or (window["others_cpus"] or 0.0) < (best[1]["others_cpus"] or 0.0):
            best = (medians, window)
        if window["contended"] is not True:
            best = (medians, window)
            break
        if failures:
            runners = [r for r in runners if r.name not in failures]
    medians, window = best
    medians = {name: m for name, m in medians.items() if not failures or name not in failures}
    return medians, dict(window, attempts=attempt)


# Calls captured in one CUDA graph when timing forward cases on CUDA.
GRAPH_CALLS = 100


def graph_replay_time(fn: Callable[[], object], calls: int = GRAPH_CALLS, reps: int = 20) -> float:
    """Seconds per call with ``calls`` calls of ``fn()`` captured in one CUDA graph and the graph
    replayed (median over ``reps`` replays): the call as a serving loop that captures its step
    pays for it, with no Python and no launch overhead per call. (Also used by benchmarks/gpu.py
    and benchmarks/gpu_configs.py.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    clock = _Clock(torch.device("cuda"))
    stamps = [clock.call(graph.replay, ()) for _ in range(reps)]
    return statistics.median(clock.resolve(stamps)) / calls


def graph_call_time(runner: Runner) -> float:
    """:func:`graph_replay_time` of a runner on one set of its arguments (in-place runners then
    work on one input set throughout: the values drift, the work per call does not)."""
    args = runner.args()
    return graph_replay_time(lambda: runner.fn(*args))


def copy_bandwidth(device: torch.device, megabytes: int = 256, reps: int = 10) -> float:
    """The machine's copy bandwidth in GB/s: ``dst.copy_(src)`` of ``megabytes`` MB, counted as
    read + write bytes over the median time."""
    n = (megabytes << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    clock = _Clock(device)
    for _ in range(2):
        dst.copy_(src)
    stamps = [clock.call(dst.copy_, (src,)) for _ in range(reps)]
    return 2 * n * 4 / statistics.median(clock.resolve(stamps)) / 1e9


def settle(meter: contention.Meter, max_wait_s: float, stream=None) -> dict:
    """Before timing: look for one second at what else runs on the CPUs; when other work holds
    them (:func:`dsnorm.contention.judge`), say so on ``stream`` (stderr) and wait up to
    ``max_wait_s`` seconds for it to stop (:meth:`~dsnorm.contention.Meter.settle`), then say
    whether it did. Returns the settle record kept in the JSON (``max_wait_s`` added)."""
    stream = stream or sys.stderr
    first = meter.quiet_window(1.0)
    record = {"max_wait_s": max_wait_s, "waited_s": first["seconds"], "settled": first["contended"] is not True,
              "last": first}
    if first["contended"] is not True:
        return record
    print(f"dsnorm bench: other work holds {_held(first)}; waiting up to "
          f"{max_wait_s:g}s for it to stop (--settle 0: do not wait)", file=stream, flush=True)
    waited = meter.settle(max(0.0, max_wait_s - first["seconds"]))
    record.update(waited_s=first["seconds"] + waited["waited_s"], settled=waited["settled"], last=waited["last"])
    if record["settled"]:
        print(f"dsnorm bench: the CPUs are quiet after {record['waited_s']:.0f}s; timing", file=stream, flush=True)
    else:
        print(f"dsnorm bench: still busy after {record['waited_s']:.0f}s (other work holds "
              f"{_held(waited['last'])}); timing anyway: a case timed under "
              "contention is timed again, then marked", file=stream, flush=True)
    return record


def _held(window: dict) -> str:
    """How much of the CPUs other work held in a :func:`dsnorm.contention.judge` window, in words."""
    if window.get("others_cpus") is None:
        return "? CPUs"
    return f"{window['others_cpus']:.1f} CPUs ({100 * window['others_share']:.0f}% of them)"
