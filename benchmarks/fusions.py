"""CPU (or CUDA) timing of dsnorm's inference fusions against their eager compositions.

    python benchmarks/fusions.py            # all cases
    python benchmarks/fusions.py --quick    # fewer shapes
    python benchmarks/fusions.py --device cuda
    python benchmarks/fusions.py --threads 1  # serial kernels: steadier on a shared machine

The cases come from ``dsnorm.fusions.bench_cases()`` (also what ``dsnorm bench`` can call):

* ``fused_add_rms_norm_fp8`` / ``rms_norm_fp8`` (ue8m0, the 671B config) vs the two-step
  ``act_quant_ref(dsnorm norm)`` (the eager act_quant on dsnorm's own norm), [1, rows, 7168] bf16;
* ``final_norm`` (last position only) vs the full ``fused_add_rms_norm`` then ``[:, -1]``, T = 4096;
* ``mla_latent_norms`` (one launch) vs two ``rms_norm`` calls, decode B = 1..64.

Median wall time over repeated calls (after warm-up, which also compiles), speedup, and the fused
call's GB/s over its byte model (inputs read once, outputs written once). Before timing, each
case's two results are checked equal (fp8 q/scales and norms bitwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def _time(fn, device: str, min_time: float = 0.2, max_reps: int = 2000) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    samples = []
    t_end = time.perf_counter() + min_time
    while len(samples) < max_reps and (len(samples) < 5 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _same(a, b) -> bool:
    for ta, tb in zip(a, b):
        if ta.dtype == torch.float8_e4m3fn:
            ta, tb = ta.view(torch.uint8), tb.view(torch.uint8)
            nan_a, nan_b = (ta & 0x7F) == 0x7F, (tb & 0x7F) == 0x7F
            if not (torch.equal(nan_a, nan_b) and torch.equal(ta[~nan_a], tb[~nan_b])):
                return False
        elif not torch.equal(ta.nan_to_num(), tb.nan_to_num()):
            return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (dsnorm follows it)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dsnorm.fusions import bench_cases

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {args.device}, "
          f"load average {os.getloadavg()[0]:.2f} (1 min)")
    header = f"{'case':<30} {'shape':<32} {'fused us':>10} {'baseline us':>12} {'speedup':>8} {'GB/s':>7}  baseline"
    print(header)
    print("-" * len(header))
    ok = True
    for case in bench_cases(quick=args.quick, device=args.device):
        same = _same(case["fused"](), case["baseline"]())
        ok &= same
        t_f = _time(case["fused"], args.device)
        t_b = _time(case["baseline"], args.device)
        print(f"{case['name']:<30} {case['shape']:<32} {t_f * 1e6:>10.1f} {t_b * 1e6:>12.1f} {t_b / t_f:>7.1f}x "
              f"{case['bytes'] / t_f / 1e9:>7.1f}  {case['baseline_name']}{'' if same else '  RESULTS DIFFER'}",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
