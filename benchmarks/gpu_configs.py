"""Launch-configuration sweep for the Triton kernels: the data behind dsnorm.triton.launch's heuristics.

    python benchmarks/gpu_configs.py [--json FILE]      # on a CUDA machine

About 40 s on an H200 (37 s measured with Triton 3.6).

For the DeepSeek shapes (bf16; N in 7168, 1536, 512-of-576; decode M=1 and 64, prefill M=16384)
it times the forward (fused and plain) with every ``num_warps`` in 1..32 that covers the row, and
at prefill the backward (fused at every width, plain at 7168) with prefetch off and on, each with
1-3 software-pipelining stages (benchmarks/bwd_stages.py's launch: the library's backward is not
pipelined), then with its programs' thread budget (``BWD_PROGRAM_THREADS`` /
``BWD_PROGRAM_THREADS_WIDE``) and ``num_warps`` varied, by overriding ``launch.config`` /
``launch.backward_config`` / those budgets / ``launch.BWD_PREFETCH`` for the sweep only (plus the
fused forward in fp32 at [16384, 7168]).
Prefill and backward: median of ``triton.testing.do_bench`` (L2 flushed), GB/s from the byte model
of benchmarks/gpu.py. Decode: microseconds per call replayed from a CUDA graph of 200 calls, where
launch overhead is gone and what is left is the kernel's latency. The row marked ``*`` is what the
heuristic picks. Nothing here changes the library; results are read by a person.
"""

from __future__ import annotations

import argparse
import json
import sys

EPS = 1e-6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_configs.py: no CUDA device", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from dsnorm.bench.timing import graph_replay_time
    from dsnorm.triton import launch

    import bwd_stages  # benchmarks/bwd_stages.py, beside this script: the pipelined backward

    real_config, real_bwd_config, real_threads = launch.config, launch.backward_config, launch.BWD_PROGRAM_THREADS
    real_wide_threads = launch.BWD_PROGRAM_THREADS_WIDE
    real_prefetch, real_min_block = launch.BWD_PREFETCH, launch.BWD_PREFETCH_MIN_BLOCK
    rows = []

    def inputs(m, n, parent=None):
        g = torch.Generator(device="cuda").manual_seed(m + n)
        width = parent or n
        x = torch.randn(m, width, device="cuda", generator=g).bfloat16()[:, :n]
        r = (4 * torch.randn(m, width, device="cuda", generator=g)).bfloat16()[:, :n]
        dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).float()
        return x, r, dy, w

    def graphed_us(fn):
        return graph_replay_time(fn, calls=200, reps=10) * 1e6

    def with_warps(real, warps):
        # ``real``'s (BLOCK_N, num_warps, single_block) with the warps replaced.
        return lambda n_, dt_, *kind: (lambda c: (c[0], warps, c[2]))(real(n_, dt_, *kind))

    def record(kind, m, n, knob, us, nbytes, picked):
        gbs = nbytes / (us * 1e-6) / 1e9 if nbytes else None
        rows.append(dict(kind=kind, M=m, N=n, knob=knob, us=us, gbs=gbs, picked=picked))
        print(f"{kind:12s} M={m:6d} N={n:5d} {knob:34s} {us:9.2f} us"
              + (f" {gbs:7.0f} GB/s" if gbs else "") + (" *" if picked else ""), flush=True)

    shapes = [(1, 7168, None), (64, 7168, None), (16384, 7168, None), (1, 1536, None), (64, 1536, None),
              (16384, 1536, None), (1, 512, 576), (64, 512, 576), (16384, 512, 576)]
    for m, n, parent in shapes:
        x, r, dy, w = inputs(m, n, parent)
        block, picked_warps, single = real_config(n, torch.bfloat16)
        for fused in (True, False):
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            ro = torch.empty_like(y) if fused else None
            res = r if fused else None
            for warps in (1, 2, 4, 8, 16, 32):
                if block // warps // 32 > 64 or block // warps // 32 < 1:
                    continue  # more than 64 values a thread spills; fewer than one leaves threads idle
                launch.config = with_warps(real_config, warps)
                try:
                    def fn():
                        launch.forward(x, res, w, EPS, False, False, y, ro, None)

                    us = graphed_us(fn) if m <= 64 else do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
                finally:
                    launch.config = real_config
                nbytes = (4 if fused else 2) * m * n * 2 + 4 * n
                record("fwd-fused" if fused else "fwd-plain", m, n, f"warps={warps}", us, nbytes,
                       warps == picked_warps)
        if m < 4096:
            continue
        # The backward, fused (dx, dresidual, dweight) at every width and plain (dx, dweight) at the
        # hidden width, where it is furthest below the goal: prefetch off/on with 1-3 pipelining
        # stages, then the programs' thread budget against the warps.
        for fused in (True, False):
            if not fused and n != 7168:
                continue
            res = r if fused else None
            kind = "bwd-fused" if fused else "bwd-plain"
            nbytes = (5 if fused else 3) * m * n * 2 + 4 * m + 8 * n
            rstd = torch.empty(m, device="cuda")
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            ro = torch.empty_like(y) if fused else None
            launch.forward(x, res, w, EPS, False, False, y, ro, rstd)
            dx, dw = torch.empty_like(y), torch.empty(n, device="cuda")
            dr = torch.empty_like(y) if fused else None

            def bwd(stages=1):
                if stages == 1:  # the library's backward
                    launch.backward(dy, x, res, w, rstd, None, False, dx, dr, dw)
                else:
                    bwd_stages.backward(dy, x, res, w, rstd, None, False, dx, dr, dw, stages)

            bwd_block, bwd_warps, _ = real_bwd_config(n, torch.bfloat16, fused)
            picked_prefetch = real_prefetch and bwd_block >= real_min_block
            picked_threads = launch.BWD_PROGRAM_THREADS_WIDE if bwd_block >= launch.BWD_WIDE_BLOCK else real_threads
            picked_stages = 1  # the library's backward is not pipelined
            variants = [(bwd_warps, stages, prefetch) for stages in (1, 2, 3) for prefetch in (False, True)]
            if n == 7168 and bwd_warps < 32:  # 32 warps hold 64 registers a thread: pipelined rows instead of prefetched ones
                variants += [(2 * bwd_warps, 3, False), (2 * bwd_warps, 3, True)]
            for warps, stages, prefetch in variants:
                launch.BWD_PREFETCH, launch.BWD_PREFETCH_MIN_BLOCK = prefetch, 1
                launch.backward_config = with_warps(real_bwd_config, warps)
                try:
                    us = do_bench(lambda: bwd(stages), warmup=10, rep=50, return_mode="median") * 1e3
                finally:
                    launch.BWD_PREFETCH, launch.BWD_PREFETCH_MIN_BLOCK = real_prefetch, real_min_block
                    launch.backward_config = real_bwd_config
                record(kind, m, n, f"warps={warps} prefetch={prefetch} stages={stages}", us, nbytes,
                       warps == bwd_warps and prefetch == picked_prefetch and stages == picked_stages)
            for threads in (1 << 17, 1 << 18, 1 << 19):
                for warps in (bwd_warps // 2, bwd_warps, bwd_warps * 2):
                    if warps > 32 or warps < 1:
                        continue
                    launch.BWD_PROGRAM_THREADS = launch.BWD_PROGRAM_THREADS_WIDE = threads
                    launch.backward_config = with_warps(real_bwd_config, warps)
                    try:
                        us = do_bench(bwd, warmup=10, rep=50, return_mode="median") * 1e3
                    finally:
                        launch.backward_config, launch.BWD_PROGRAM_THREADS = real_bwd_config, real_threads
                        launch.BWD_PROGRAM_THREADS_WIDE = real_wide_threads
                    record(kind, m, n, f"threads=2^{threads.bit_length() - 1} warps={warps}", us, nbytes,
                           threads == picked_threads and warps == bwd_warps)
    # fp32 activations at the hidden width: is the bf16-measured forward rule right for 4-byte elements?
    m, n = 16384, 7168
    x, r, _, w = inputs(m, n)
    x, r = x.float(), r.float()
    y, ro = torch.empty_like(x), torch.empty_like(r)
    picked = real_config(n, torch.float32)[1]
    for warps in (4, 8, 16, 32):
        launch.config = with_warps(real_config, warps)
        try:
            us = do_bench(lambda: launch.forward(x, r, w, EPS, False, False, y, ro, None), warmup=10, rep=50,
                          return_mode="median") * 1e3
        finally:
            launch.config = real_config
        record("fwd-fused-f32", m, n, f"warps={warps}", us, 4 * m * n * 4 + 4 * n, warps == picked)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
