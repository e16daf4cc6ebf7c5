"""Host-side cost of an eager CUDA call: where the Python time of dsnorm's call path goes.

    python benchmarks/gpu_host_profile.py        # on a CUDA machine, a few seconds

A decode-sized fused norm ([64, 7168] bf16) is a few microseconds of GPU work, so an eager call's
time is the host's: the Python layers, the dispatcher and Triton's launcher. This prints, per call,
the wall time of (a) the Triton launcher alone (and with ``launch.DIRECT_LAUNCH`` off, every launch
through Triton's own ``kernel[grid]``, as also for (d)), (b) dsnorm's public function under no_grad, (c) the
same forward in grad mode alone (what it saves, no backward) and (d) with the backward through
autograd, and Liger's fused-add function for (b)-(d) when it is importable, and for scale what
the host costs anyway (an allocation, ``torch.add``, and ``torch.add``'s forward + backward through
autograd): each over 300 calls with one synchronize at the end (so the GPU never waits for the
host's clock), in 3 interleaved rounds (median printed); then cProfile's top entries for (d), by
own time and by cumulative time, and Liger's fwd+bwd by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

CALLS = 300
ROUNDS = 3


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
    def triton_launch(fn):
        # The same call with launch.DIRECT_LAUNCH off: every launch through Triton's own
        # ``kernel[grid](...)``, which binds and specialises the arguments each time.
        def call():
            launch.DIRECT_LAUNCH = False
            try:
                fn()
            finally:
                launch.DIRECT_LAUNCH = True
        return call

    cases["launcher, Triton's"] = triton_launch(launcher)
    cases["dsnorm f+b, Triton's"] = triton_launch(cases["dsnorm fwd+bwd"])
    # What the host costs anyway: an allocation, a torch op, and a torch op's forward + backward
    # through autograd (the engine's own share of a training step).
    cases["torch.empty_like"] = lambda: torch.empty_like(x)
    cases["torch.add"] = lambda: torch.add(x, r)
    cases["torch.add fwd+bwd"] = train(lambda a, b, c: (torch.add(a, b), torch.mul(b, c)), True)
    per_call = {name: [] for name in cases}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
    for _ in range(ROUNDS):  # interleaved, so that the host's drift falls on every case alike
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(CALLS):
                fn()
            torch.cuda.synchronize()
            per_call[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    for name, times in per_call.items():
        print(f"{name:21s} {statistics.median(times):8.1f} us per call (median of {ROUNDS} rounds; "
              f"min {min(times):.1f}, max {max(times):.1f})", flush=True)
    for name in ("dsnorm fwd+bwd", "liger fwd+bwd"):
        if name not in cases:
            continue
        print(f"\n--- cProfile of {name}, {CALLS} calls")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(CALLS):
            cases[name]()
        torch.cuda.synchronize()
        profile.disable()
        stats = pstats.Stats(profile, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(18)
        if name.startswith("dsnorm"):
            stats.sort_stats("cumulative").print_stats(26)
    return 0


if __name__ == "__main__":
    sys.exit(main())
