"""``python benchmarks/allocators.py [--trees NAME=SRC,...] [--rounds N] [--shapes prefill,decode]``:
dsnorm's allocating forms against ``torch.compile(reference)`` under glibc, tcmalloc and jemalloc.

Each (round, allocator, tree) runs in a fresh process with ``LD_PRELOAD`` set (none for glibc;
Debian's ``libtcmalloc-minimal4`` and ``libjemalloc2``) and ``PYTHONPATH`` at the tree's ``src``, so
two commits compare in one session, interleaved round by round. A process times every method of a
shape in turn, ``--reps`` times, and counts minor page faults per call (``getrusage``); the table
gives the median over all of a method's timings and the page faults of the last round. Not a test:
it only reports (see docs/performance.md for the recorded runs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = Path("/usr/lib/x86_64-linux-gnu")
ALLOCATORS = {"glibc": None, "tcmalloc": LIBS / "libtcmalloc_minimal.so.4", "jemalloc": LIBS / "libjemalloc.so.2"}
SHAPES = {"prefill": (1, 4096, 7168), "decode": (64, 1, 7168)}


def _methods(shape):
    import torch

    import dsnorm
    from dsnorm.ref import fused_add_rms_norm_fp8_ref, fused_add_rms_norm_ref, rms_norm_ref

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    r = (4 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    xi, ri = x.clone(), r.clone()

    def last(h, res, weight):
        y, s = fused_add_rms_norm_ref(h, res, weight)
        return y[:, -1], s[:, -1]

    compiled = {name: torch.compile(f) for name, f in (
        ("plain", rms_norm_ref), ("fused", fused_add_rms_norm_ref), ("fp8", fused_add_rms_norm_fp8_ref),
        ("final", last))}
    return {
        "plain compile": lambda: compiled["plain"](x, w),
        "plain dsnorm": lambda: dsnorm.rms_norm(x, w),
        "fused compile": lambda: compiled["fused"](x, r, w),
        "fused dsnorm": lambda: dsnorm.fused_add_rms_norm(x, r, w),
        "fused dsnorm in place": lambda: dsnorm.fused_add_rms_norm_(xi, ri, w),
        "fp8 compile": lambda: compiled["fp8"](x, r, w),
        "fp8 dsnorm": lambda: dsnorm.fused_add_rms_norm_fp8(x, r, w),
        "final compile": lambda: compiled["final"](x, r, w),
        "final dsnorm": lambda: dsnorm.final_norm(x, r, w),
    }


def worker(shape, reps: int) -> dict:
    import torch

    torch.set_grad_enabled(False)
    methods = _methods(shape)
    for f in methods.values():  # compile, numba's first call, the heap's first sizes
        for _ in range(3):
            f()
    inner = 3 if shape[0] * shape[1] >= 1024 else 100
    times = {k: [] for k in methods}
    faults = {}
    for _ in range(reps):
        for name, f in methods.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(inner):
                out = f()
                del out  # freed before the next call, as a model frees a layer's outputs
            t1 = time.perf_counter()
            times[name].append((t1 - t0) / inner)
            faults[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / inner
    return {"times": times, "faults": faults}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=f"this={ROOT / 'src'}", help="NAME=SRC pairs, comma-separated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", default="prefill,decode")
    p.add_argument("--allocators", default=",".join(ALLOCATORS))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        json.dump(worker(SHAPES[args.worker], args.reps), sys.stdout)
        return 0
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    allocators = {a: ALLOCATORS[a] for a in args.allocators.split(",")}
    missing = [f"{a} ({lib})" for a, lib in allocators.items() if lib is not None and not lib.exists()]
    if missing:
        raise SystemExit(f"not installed: {', '.join(missing)} (apt-get install libtcmalloc-minimal4 libjemalloc2)")
    results = {}
    for rnd in range(args.rounds):
        for shape in args.shapes.split(","):
            for alloc, lib in allocators.items():
                for tree, src in trees.items():
                    env = dict(os.environ, PYTHONPATH=src)
                    env.pop("LD_PRELOAD", None)
                    if lib is not None:
                        env["LD_PRELOAD"] = str(lib)
                    out = subprocess.run([sys.executable, __file__, "--worker", shape, "--reps", str(args.reps)],
                                         env=env, capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(f"{tree} {alloc} {shape}: {out.stderr[-2000:]}")
                    res = json.loads(out.stdout)
                    slot = results.setdefault((shape, alloc, tree), {"times": {}, "faults": {}})
                    for k, v in res["times"].items():
                        slot["times"].setdefault(k, []).extend(v)
                    slot["faults"] = res["faults"]
                    print(f"round {rnd + 1}: {shape} {alloc} {tree} done", file=sys.stderr, flush=True)
    for (shape, alloc, tree), slot in results.items():
        print(f"\n{shape} {SHAPES[shape]} bf16, {alloc}, {tree}")
        for k, v in slot["times"].items():
            ms = [t * 1e3 for t in v]
            print(f"  {k:24} {statistics.median(ms):9.3f} ms  (min {min(ms):.3f}, max {max(ms):.3f})"
                  f"  faults/call {slot['faults'][k]:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
