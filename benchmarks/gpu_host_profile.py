"""Host-side cost of an eager CUDA call: where the Python time of dsnorm's call path goes.

    python benchmarks/gpu_host_profile.py        # on a CUDA machine, a few seconds

A decode-sized fused norm ([64, 7168] bf16) is a few microseconds of GPU work, so an eager call's
time is the host's: the Python layers, the dispatcher and Triton's launcher. This prints, per call,
the wall time of (a) the Triton launcher alone, (b) dsnorm's public function under no_grad, (c) the
same forward in grad mode alone (what it saves, no backward) and (d) with the backward through
autograd, and Liger's fused-add function for (b)-(d) when it is importable, each over 300 calls
with one synchronize at the end (so the GPU never waits for the host's clock); then cProfile's top
entries for (d), by own time and by cumulative time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_host_profile.py: no CUDA device", file=sys.stderr)
        return 2
    import dsnorm
    from dsnorm.triton import launch

    x = torch.randn(64, 7168, device="cuda").bfloat16()
    r = torch.randn_like(x)
    w = torch.ones(7168, device="cuda")
    dy, dres = torch.randn_like(x), torch.randn_like(x)
    y, ro = torch.empty_like(x), torch.empty_like(x)

    def launcher():
        launch.forward(x, r, w, 1e-6, False, False, y, ro, None)

    def api():
        with torch.no_grad():
            dsnorm.fused_add_rms_norm(x, r, w)

    def train(fn, backward=True):
        def step():
            xg, rg, wg = x.detach().requires_grad_(), r.detach().requires_grad_(), w.detach().requires_grad_()
            out = fn(xg, rg, wg)
            if backward:
                torch.autograd.backward(out, (dy, dres))
        return step

    cases = {"launcher": launcher, "dsnorm no_grad": api,
             "dsnorm fwd (grad)": train(lambda a, b, c: dsnorm.fused_add_rms_norm(a, b, c), False),
             "dsnorm fwd+bwd": train(lambda a, b, c: dsnorm.fused_add_rms_norm(a, b, c))}
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction as Liger

        def liger_fwd():
            with torch.no_grad():
                Liger.apply(x, r, w, 1e-6, 0.0, "gemma", False)

        cases["liger no_grad"] = liger_fwd
        cases["liger fwd (grad)"] = train(lambda a, b, c: Liger.apply(a, b, c, 1e-6, 0.0, "gemma", False), False)
        cases["liger fwd+bwd"] = train(lambda a, b, c: Liger.apply(a, b, c, 1e-6, 0.0, "gemma", False))
    except ImportError as e:
        print(f"liger not measured: {e}")
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        print(f"{name:18s} {(time.perf_counter() - t0) / 300 * 1e6:8.1f} us per call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        cases["dsnorm fwd+bwd"]()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
