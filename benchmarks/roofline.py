"""``python benchmarks/roofline.py [--rows 4096] [--width 7168] [--reps 20]``: the memory roofline
that the CPU norms at prefill are measured against.

Two numba kernels over bf16 bit patterns (uint16), each on torch's thread count, touching exactly the
bytes of a fused norm and doing no arithmetic worth the name:

* read-modify-write: read ``x`` and ``r``, write both back in place (``fused_add_rms_norm_``'s
  traffic);
* read-read-write-write: read ``x`` and ``r``, write two other buffers that already exist (the
  allocating form's traffic once its outputs are recycled memory: the destination lines are read
  for ownership before they are written).

Prints the median time of each and the GB/s of the bytes a norm must move (inputs read once,
outputs written once). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from numba import njit, prange, set_num_threads


@njit(parallel=True, cache=False)
def _rmw(x, r):
    for i in prange(x.shape[0]):
        a = x[i]
        x[i] = r[i]
        r[i] = a


@njit(parallel=True, cache=False)
def _rrww(x, r, y, s):
    for i in prange(x.shape[0]):
        y[i] = r[i]
        s[i] = x[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--width", type=int, default=7168)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    set_num_threads(torch.get_num_threads())
    n = args.rows * args.width
    rng = np.random.default_rng(0)
    x, r = (rng.integers(0, 1 << 16, n, dtype=np.uint16) for _ in range(2))
    y, s = np.empty_like(x), np.empty_like(x)
    y[:] = 0
    s[:] = 0
    kernels = {"read-modify-write (in place)": lambda: _rmw(x, r),
               "read, write two others (allocating, recycled)": lambda: _rrww(x, r, y, s)}
    for f in kernels.values():
        f()
    times = {k: [] for k in kernels}
    for _ in range(args.reps):
        for k, f in kernels.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    moved = 4 * n * 2  # two bf16 inputs read, two written
    print(f"[{args.rows}, {args.width}] bf16, {torch.get_num_threads()} threads, {moved / 1e6:.1f} MB moved")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"  {k:48} {med * 1e3:8.3f} ms  {moved / med / 1e9:6.1f} GB/s  (min {min(v) * 1e3:.3f})")


if __name__ == "__main__":
    main()
