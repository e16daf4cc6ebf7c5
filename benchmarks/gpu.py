"""GPU benchmark of dsnorm's Triton kernels against the reference and other implementations.

Run on a CUDA machine (written for torch 2.11 + Triton 3.6, uses nothing newer):

    python benchmarks/gpu.py            # full sweep (several minutes)
    python benchmarks/gpu.py --quick    # fewer shapes and repetitions, < 2 minutes
    python benchmarks/gpu.py --json out.json

One process, in this order:

1. Device copy bandwidth: ``dst.copy_(src)`` of a 1 GiB bf16 tensor (2 GiB moved per copy). Every
   GB/s below is also given as a percentage of it: a memory-bound norm cannot beat a copy.
2. For each op (``rms_norm`` and ``fused_add`` forward, the launcher's backward, and fwd+bwd
   through autograd), each shape M x N (M in {1, 8, 64, 4096, 16384}; N in {7168, 1536, 512 as a
   512-of-576 strided slice}, bf16) and each implementation available:
   dsnorm's launchers called directly, dsnorm's public API (when it works on CUDA),
   ``torch.compile`` of ``dsnorm.ref.RMSNormRef``, Liger, flashinfer and quack (when importable).
   Median time by ``triton.testing.do_bench`` (L2 flushed between calls), GB/s from the byte model
   below, and a check of every result against ``dsnorm.ref`` on the CPU (first rows only):
   max ulp of y, and whether residual_out is bitwise equal. Other libraries use other roundings;
   their ulp column is information, not a failure (each is checked against the reference of the
   rounding it implements: ``fp32_sum`` or ``round_first``, whichever is closer).
3. Decode latency: bs=1, N=7168, fused add, 100 calls captured in one CUDA graph, time per call;
   and the same calls launched eagerly from Python.

Byte model (bytes that must cross DRAM, e = element size of x, M rows of N used columns; the
strided 576-wide rows count only their 512 used columns; weight is fp32):

* rms_norm forward:    read x, write y                          = 2*M*N*e + 4*N
* fused_add forward:   read x, residual; write y, residual_out  = 4*M*N*e + 4*N
* rms_norm backward:   read dy, x, rstd; write dx; dweight      = 3*M*N*e + 4*M + 8*N
* fused_add backward:  read dy, x, residual, rstd; write dx, dresidual
                                                                = 5*M*N*e + 4*M + 8*N
  (impl ``dsnorm.shared``: dresidual not written, dx serving both, as the autograd Functions
  launch it along a chain of fused norms: 4*M*N*e + 4*M + 8*N)
  (dsnorm's dweight partials, [programs, N] fp32 written then summed, are overhead not counted.)
* fwd+bwd: the sum of the two (training saves rstd: + 4*M in the forward).

Exit status: 0 when every dsnorm result verified (y within 1 ulp, residual bitwise, rows batch
invariant, backward within tolerance of fp64), 1 otherwise, 2 when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

EPS = 1e-6
SHAPES_M = [1, 8, 64, 4096, 16384]
SHAPES_N = [(7168, None), (1536, None), (512, 576)]
QUICK_M = [1, 64, 16384]
VERIFY_ROWS = 64


def _fail_no_cuda() -> int:
    print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False); nothing was measured.",
          file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------
# Checking results.


def _ordered(t):
    import torch

    if t.dtype == torch.float32:
        bits = t.view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    else:
        bits = t.view(torch.int16).to(torch.int64)
        mag = bits & 0x7FFF
    return torch.where(bits < 0, -mag, mag)


def max_ulp(a, b) -> float:
    """Max ulp distance (NaN must match NaN; a mismatch counts as inf)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    if not bool((a.isnan() == b.isnan()).all()):
        return float("inf")
    keep = ~a.isnan()
    if not bool(keep.any()):
        return 0.0
    return float((_ordered(a[keep]) - _ordered(b[keep])).abs().max())


def bitwise(a, b) -> bool:
    import torch

    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a.masked_fill(nan, 0).view(torch.uint8), b.masked_fill(nan, 0).view(torch.uint8))


def ref_forward(x, r, w, rounding="fp32_sum"):
    """dsnorm.ref on the CPU for the first VERIFY_ROWS rows: (y, residual_out or None)."""
    from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref

    xs = x[:VERIFY_ROWS].cpu()
    ws = w.float().cpu()
    if r is None:
        return rms_norm_ref(xs, ws, EPS), None
    return fused_add_rms_norm_ref(xs, r[:VERIFY_ROWS].cpu(), ws, EPS, "deepseek", rounding)


def check_forward(x, r, w, y, ro):
    """(max ulp of y, residual bitwise or None, rounding matched) against the closer reference."""
    best = None
    for rounding in (("fp32_sum", "round_first") if r is not None else ("fp32_sum",)):
        y_ref, ro_ref = ref_forward(x, r, w, rounding)
        ulp = max_ulp(y[:VERIFY_ROWS], y_ref)
        res = None if ro is None else bitwise(ro[:VERIFY_ROWS], ro_ref)
        cand = (ulp, res, rounding)
        if best is None or (res, -ulp) > (best[1], -best[0]):
            best = cand
    return best


# ---------------------------------------------------------------------------------------------
# Timing.


def bench(fn, quick: bool) -> float:
    """Median milliseconds of fn() (L2 flushed before each call by do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 200, return_mode="median")


def copy_bandwidth(quick: bool) -> float:
    import torch

    n = (1 << 30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), quick)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def fwd_bytes(op, m, n, e):
    return (2 if op == "rms_norm" else 4) * m * n * e + 4 * n


def bwd_bytes(op, m, n, e, shared=False):
    return (3 if op == "rms_norm" else 4 if shared else 5) * m * n * e + 4 * m + 8 * n


# ---------------------------------------------------------------------------------------------
# Implementations. Each maker returns None (not available: reason printed once) or a callable
# run() -> (y, residual_out or None), set up for one shape.


class Unavailable(Exception):
    pass


def _rows(m, n, stride, dtype, gen, scale=1.0):
    import torch

    width = n if stride is None else stride
    t = (torch.randn(m, width, device="cuda", generator=gen) * scale).to(dtype)
    return t[:, :n]


def make_inputs(m, n, stride, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _rows(m, n, stride, torch.bfloat16, gen)
    r = _rows(m, n, stride, torch.bfloat16, gen, 4.0)
    w = (1.0 + 0.1 * torch.randn(n, device="cuda", generator=gen)).float()
    dy = _rows(m, n, stride, torch.bfloat16, gen)
    return x, r, w, dy


def impl_dsnorm_launch(op, x, r, w):
    import torch

    from dsnorm.triton import launch

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ro = None if op == "rms_norm" else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res = None if op == "rms_norm" else r

    def run():
        launch.forward(x, res, w, EPS, False, False, y, ro, None)
        return y, ro

    return run


def impl_dsnorm_api(op, x, r, w):
    import dsnorm

    if op == "rms_norm":
        return lambda: (dsnorm.rms_norm(x, w, EPS), None)
    return lambda: dsnorm.fused_add_rms_norm(x, r, w, EPS)


_COMPILED = {}


def impl_compiled_ref(op, x, r, w):
    import torch

    from dsnorm.ref import RMSNormRef

    n = x.shape[1]
    key = (op, n)
    if key not in _COMPILED:
        mod = RMSNormRef(n, EPS).to(x.device)
        _COMPILED[key] = (mod, torch.compile(mod, dynamic=True))
    mod, fn = _COMPILED[key]
    with torch.no_grad():
        mod.weight.copy_(w)
    if op == "rms_norm":
        return lambda: (fn(x), None)
    return lambda: fn(x, r)


def impl_liger(op, x, r, w):
    import torch

    try:
        if op == "rms_norm":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm as Cls
        else:
            from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm as Cls
    except ImportError as e:
        raise Unavailable(f"liger_kernel: {e}")
    # casting_mode="gemma": everything in fp32, one rounding at the end (closest to DeepSeek's).
    # in_place=False: Liger's default for the plain norm writes dx over dy, which later rows reuse.
    mod = Cls(x.shape[1], eps=EPS, casting_mode="gemma", in_place=False).to(x.device)
    with torch.no_grad():
        mod.weight.copy_(w)
    if op == "rms_norm":
        return lambda: (mod(x), None)
    return lambda: mod(x, r)


def impl_flashinfer(op, x, r, w):
    try:
        import flashinfer
    except ImportError as e:
        raise Unavailable(f"flashinfer: {e}")
    wx = w.to(x.dtype)  # flashinfer takes the weight in x's dtype (a rounding the reference lacks)
    if op == "rms_norm":
        return lambda: (flashinfer.norm.rmsnorm(x, wx, EPS), None)
    xc, rc = x.contiguous(), r.contiguous()
    bx, br = xc.clone(), rc.clone()

    def run():
        # In place (x <- y, residual <- s): restore the inputs first; the restore is timed too.
        bx.copy_(xc)
        br.copy_(rc)
        flashinfer.norm.fused_add_rmsnorm(bx, br, wx, EPS)
        return bx, br

    return run


def impl_quack(op, x, r, w):
    try:
        from quack.rmsnorm import rmsnorm
    except ImportError as e:
        raise Unavailable(f"quack: {e}")
    if op == "rms_norm":
        return lambda: (rmsnorm(x, w, eps=EPS), None)
    return lambda: rmsnorm(x, w, residual=r, eps=EPS, prenorm=True)


FORWARD_IMPLS = {
    "dsnorm.launch": impl_dsnorm_launch,
    "dsnorm.api": impl_dsnorm_api,
    "compile(ref)": impl_compiled_ref,
    "liger": impl_liger,
    "flashinfer": impl_flashinfer,
    "quack": impl_quack,
}


# ---------------------------------------------------------------------------------------------
# Backward.


def dsnorm_backward_runner(op, x, r, w, dy, shared=False):
    """The launcher's backward after a forward that saved rstd; returns run() and a checker.
    ``shared``: no dresidual written (dx serves both, as along a chain of fused norms)."""
    import torch

    from dsnorm.ref import rms_norm_backward_ref
    from dsnorm.triton import launch

    m, n = x.shape
    res = None if op == "rms_norm" else r
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ro = None if res is None else torch.empty_like(y)
    rstd = torch.empty(m, device=x.device)
    launch.forward(x, res, w, EPS, False, False, y, ro, rstd)
    dx = torch.empty_like(y)
    dr = None if res is None or shared else torch.empty_like(y)
    dw = torch.empty(n, device=x.device)

    def run():
        launch.backward(dy, x, res, w, rstd, None, False, dx, dr, dw)
        return dx, dr, dw

    def check():
        run()
        dw1 = dw.clone()
        run()
        deterministic = bitwise(dw, dw1)
        s = x.float() if res is None else x.float() + res.float()
        k = min(m, VERIFY_ROWS)
        ds_ref, _ = rms_norm_backward_ref(dy[:k].cpu(), s[:k].cpu(), w.cpu(), EPS)
        # dweight over all rows, in fp64 on the GPU (the CPU autograd reference is slow at 16384 rows).
        s64 = s.double()
        xhat64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS)
        dw_ref = (dy.double() * xhat64).sum(0).cpu()
        del s64, xhat64
        term = float((dy[:k].double() * w.double() * rstd[:k, None].double()).abs().max())
        err_dx = float((dx[:k].double().cpu() - ds_ref).abs().max()) / max(term, 1e-30)
        err_dw = float((dw.double().cpu() - dw_ref).abs().max()) / max(float(dw_ref.abs().max()), 1e-30)
        ok = deterministic and err_dx < 2.0**-7 and err_dw < 1e-4
        return ok, f"dx err {err_dx:.1e} (rel. to |rstd*dy*w|), dw err {err_dw:.1e}, deterministic={deterministic}"

    return run, check


def fwd_bwd_runner(name, op, x, r, w, dy):
    """fwd+bwd through autograd (public API / compiled reference / Liger)."""
    import torch

    xg = x.detach().clone().requires_grad_(True)
    rg = r.detach().clone().requires_grad_(True)
    if name == "dsnorm.api":
        import dsnorm

        wg = w.detach().clone().requires_grad_(True)
        if op == "rms_norm":
            f = lambda: dsnorm.rms_norm(xg, wg, EPS)  # noqa: E731
        else:
            f = lambda: dsnorm.fused_add_rms_norm(xg, rg, wg, EPS)[0]  # noqa: E731
        params = [xg, wg] if op == "rms_norm" else [xg, rg, wg]
    else:
        fwd = (impl_compiled_ref if name == "compile(ref)" else impl_liger)(op, xg, rg, w)
        if name == "compile(ref)":
            mod = _COMPILED[(op, x.shape[1])][0]
        else:
            mod = None
        f = lambda: fwd()[0]  # noqa: E731
        params = [xg] if op == "rms_norm" else [xg, rg]
        if mod is not None:
            params.append(mod.weight)
    g = dy.contiguous()

    def run():
        out = f()
        return torch.autograd.grad(out, params, g)

    return run


# ---------------------------------------------------------------------------------------------
# Decode latency under a CUDA graph.


def decode_latency(quick: bool):
    import torch

    from dsnorm.bench.timing import graph_replay_time
    from dsnorm.triton import launch

    x, r, w, _ = make_inputs(1, 7168, None, seed=3)
    y, ro = torch.empty_like(x), torch.empty_like(r)
    calls = 100

    def step():
        launch.forward(x, r, w, EPS, False, False, y, ro, None)

    graphed = graph_replay_time(step, calls, 20 if quick else 100) * 1e6
    ok = check_forward(x, r, w, y, ro)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls * 5):
        step()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) * 1e6 / (calls * 5)
    return graphed, eager, ok


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (< 2 minutes)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        return _fail_no_cuda()
    import triton

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    copy_gbs = copy_bandwidth(args.quick)
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (dst.copy_(src), 1 GiB bf16)\n")

    ms_list = QUICK_M if args.quick else SHAPES_M
    impls = dict(FORWARD_IMPLS)
    if args.no_compile:
        impls.pop("compile(ref)")
    unavailable = {}
    rows = []
    all_ok = True

    def record(op, m, n, stride, name, ms, nbytes, ulp="", res="", note=""):
        gbs = nbytes / (ms * 1e-3) / 1e9
        row = dict(op=op, M=m, N=str(n) if stride is None else f"{n}/{stride}", impl=name, us=ms * 1e3, gbs=gbs,
                   pct_copy=100 * gbs / copy_gbs, max_ulp=ulp, residual_bitwise=res, note=note)
        rows.append(row)
        print(f"{op:10s} {m:6d} {row['N']:>9s} {name:14s} {row['us']:9.1f} us {gbs:7.0f} GB/s "
              f"{row['pct_copy']:5.1f}%  ulp={ulp!s:5s} res={res!s:5s} {note}", flush=True)

    header = f"{'op':10s} {'M':>6s} {'N':>9s} {'impl':14s} {'median':>12s} {'GB/s':>12s} {'%copy':>6s}"
    print(header)
    for n, stride in SHAPES_N:
        if args.quick and n == 1536:
            continue
        for m in ms_list:
            x, r, w, dy = make_inputs(m, n, stride)
            for op in ("rms_norm", "fused_add"):
                nbytes = fwd_bytes(op, m, n, x.element_size())
                for name, maker in impls.items():
                    if name in unavailable:
                        continue
                    if name == "compile(ref)" and args.quick and n != 7168:
                        continue  # each width is a separate compile: too slow for --quick
                    try:
                        run = maker(op, x, r, w)
                        y, ro = run()
                        ulp, res, rounding = check_forward(x, r if op == "fused_add" else None, w, y, ro)
                        ms = bench(run, args.quick)
                    except Unavailable as e:
                        unavailable[name] = str(e)
                        continue
                    except Exception as e:  # one implementation failing must not stop the sweep
                        if name.startswith("dsnorm"):
                            all_ok = False
                        print(f"{op:10s} {m:6d} {n:9d} {name:14s} ERROR {type(e).__name__}: {e}", flush=True)
                        if name == "dsnorm.launch":
                            traceback.print_exc()
                        if name == "dsnorm.api":
                            unavailable[name] = f"{type(e).__name__}: {e}"
                        continue
                    note = "" if op == "rms_norm" else rounding
                    if name.startswith("dsnorm"):
                        good = ulp <= 1 and res in (None, True) and rounding == "fp32_sum"
                        if name == "dsnorm.launch" and m > 1:
                            # Batch invariance: the first row alone gives the same bits.
                            y1, ro1 = impl_dsnorm_launch(op, x[:1], r[:1], w)()
                            inv = bitwise(y1, y[:1]) and (ro is None or bitwise(ro1, ro[:1]))
                            good = good and inv
                            note += " batch-invariant" if inv else " NOT batch-invariant"
                        if not good:
                            all_ok = False
                            note += " FAILED"
                    record(op, m, n, stride, name, ms, nbytes, ulp, res, note)
                # Backward: the launcher alone (fused: also with dresidual shared), then fwd+bwd
                # through autograd.
                for shared in (False, True) if op == "fused_add" else (False,):
                    impl = "dsnorm.shared" if shared else "dsnorm.launch"
                    try:
                        run, check = dsnorm_backward_runner(op, x, r, w, dy, shared)
                        ok, msg = check()
                        all_ok = all_ok and ok
                        record(op + "-bwd", m, n, stride, impl, bench(run, args.quick),
                               bwd_bytes(op, m, n, x.element_size(), shared), note=msg + ("" if ok else " FAILED"))
                    except Exception as e:
                        all_ok = False
                        print(f"{op}-bwd {m} {n} {impl} ERROR {type(e).__name__}: {e}", flush=True)
                        traceback.print_exc()
                for name in ("dsnorm.api", "compile(ref)", "liger"):
                    if name in unavailable or name not in impls:
                        continue
                    if args.quick and (m not in (64, 16384) or (name == "compile(ref)" and n != 7168)):
                        continue
                    try:
                        run = fwd_bwd_runner(name, op, x, r, w, dy)
                        run()
                        nb = fwd_bytes(op, m, n, x.element_size()) + 4 * m + bwd_bytes(op, m, n, x.element_size())
                        record(op + "-f+b", m, n, stride, name, bench(run, args.quick), nb)
                    except Exception as e:
                        print(f"{op}-f+b {m} {n} {name} ERROR {type(e).__name__}: {e}", flush=True)
            del x, r, w, dy
            torch.cuda.empty_cache()

    try:
        graphed, eager, (ulp, res, _) = decode_latency(args.quick)
        print(f"\ndecode fused_add bs=1 N=7168: {graphed:.2f} us/call in a CUDA graph, {eager:.2f} us/call eager "
              f"(launch overhead included); ulp={ulp} residual bitwise={res}")
        rows.append(dict(op="decode-graph", M=1, N=7168, impl="dsnorm.launch", us=graphed, eager_us=eager,
                         max_ulp=ulp, residual_bitwise=res))
        all_ok = all_ok and ulp <= 1 and res is True
    except Exception as e:
        all_ok = False
        print(f"decode latency ERROR {type(e).__name__}: {e}")
        traceback.print_exc()

    for name, why in unavailable.items():
        print(f"not measured: {name}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbs=copy_gbs, rows=rows, unavailable=unavailable, ok=all_ok), f, indent=1)
    print("\nall dsnorm results verified" if all_ok else "\nSOME dsnorm RESULTS FAILED VERIFICATION")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
