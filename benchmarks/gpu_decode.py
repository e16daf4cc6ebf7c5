"""Decode latency, taken apart: dsnorm's forward kernel against variants of it (an approximate rstd:
what the exact arithmetic costs; the same bits by other instructions), Liger, and optionally the
kernel of another revision.

    python benchmarks/gpu_decode.py [--baseline OLD/kernels.py] [--rounds 7] [--json FILE]

At decode sizes a norm is a few microseconds of GPU time, most of it latency: the loads, the
cross-warp sum, ``rstd`` and the stores, one after the other. dsnorm computes ``rstd`` as the
reference does on the CPU, ``1 / sqrt(sum / n + eps)`` with IEEE-rounded division and square root
(three correctly rounded operations, each a short instruction sequence with a slow-path check);
Liger and torch.compile use the hardware's approximate reciprocal square root. The ``approx rstd``
variant is dsnorm's kernel with ``_rstd`` replaced by ``rsqrt(sum / n + eps)`` (Triton's fast fp32
division and ``rsqrt``): the difference between the two rows is what exactness costs at that shape.
Its outputs are reported in ulps against dsnorm's (it is not a dsnorm mode). ``rcp_rn rstd`` takes
the reciprocal with ``rcp.rn`` instead of ``div.rn``: IEEE-rounded both, so its bits must be dsnorm's
(libdevice's ``rcp_rn`` is the flush-to-zero form, which no rstd meets: ``sqrt(var)`` lies between
about 4e-23 and 2e19, or is inf, for every accepted eps). ``pair widen`` widens bf16 inputs two
values at a time from their 32-bit word, one integer instruction a value (ptxas spends three a pair
on ``cvt.f32.bf16``; 20 fewer SASS instructions in the fused ``[*, 7168]`` kernel, 18 in the plain
one); exact, so again dsnorm's bits. ``pair+rcp_rn`` is both. ``fma sumsq`` is dsnorm's kernel
compiled with Triton's default fp fusion (an fma in the sum of squares, as before
``launch.FWD_OPTIONS`` turned it off so that every square is rounded as in the reference): what
that exactness costs, reported in ulps. ``split 2`` / ``split 4`` spread each
row over 2 / 4 programs that each load and sum the whole row (dsnorm's bits) but load the weight for,
and store, a quarter or half of it: a decode row's bytes pass through one SM, and across the widths
the kernel's time grows with them at about 65-80 bytes a ns (kv_norm to the final norm and the
fused 7168 row, session 13's runs), which is what these test. tests/test_triton_compile.py
compiles every variant for sm_90 at every shape here, so that one that cannot compile is found
without a GPU; the split kernel's bits were checked against dsnorm's under the interpreter.

``--baseline`` takes a ``dsnorm/triton/kernels.py`` of another revision (e.g. ``git show
REV:src/dsnorm/triton/kernels.py > /tmp/old_kernels.py``) and times its forward kernel with
today's launch parameters, for an A/B of a kernel change; its outputs must be bitwise dsnorm's.

Every variant is timed replayed from a CUDA graph of 200 calls (the GPU's own time per call, no
launch overhead), in ``--rounds`` interleaved rounds (each round times every variant once, so that
clock and thermal drift fall on all of them alike); the median and the minimum over rounds are
printed. bf16, DeepSeek's decode shapes. Nothing here changes the library.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import types

import triton
import triton.language as tl

EPS = 1e-6
# (label, rows, n, row stride or None, fused)
SHAPES = [
    ("attn_norm+res B=1", 1, 7168, None, True),
    ("attn_norm+res B=64", 64, 7168, None, True),
    ("q_norm B=1", 1, 1536, None, False),
    ("q_norm B=64", 64, 1536, None, False),
    ("kv_norm B=1", 1, 512, 576, False),
    ("final norm B=1", 1, 7168, None, False),
]


# The variants whose outputs may differ from dsnorm's; every other one must give its bits.
NOT_BITWISE = ("approx rstd", "fma sumsq", "liger")
# Launch options a variant sets over the library's meta: "fma sumsq" is dsnorm's kernel as it was
# compiled before launch.FWD_OPTIONS (Triton's default fp fusion, an fma in the sum of squares).
OPTIONS = {"fma sumsq": {"enable_fp_fusion": True}}

# The forward kernel and the jit helpers it reaches, callees before callers: a variant re-makes all
# of them over one patched copy of the module's globals, so that a replaced helper is seen at any depth.
_FORWARD_TREE = ("_widen", "_load_s", "_mean", "_rstd", "_blocked_rstd", "_scale", "_forward_row",
                 "rms_norm_fwd_kernel")


def _remade(fn, glb: dict):
    """``fn``'s code as a new function over the globals ``glb``."""
    made = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__)
    # The parameters' annotations (tl.constexpr, "fp64") live on the function, not its code.
    made.__annotations__, made.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
    made.__module__, made.__qualname__ = fn.__module__, fn.__qualname__ + "_rejit"
    return made


def _rejit(kernels_module, replace: dict, kernel: str = "rms_norm_fwd_kernel"):
    """The module's forward kernel compiled afresh with some of its jit helpers replaced: every
    function of ``_FORWARD_TREE`` not replaced is re-made from its own code over a patched copy of
    the module's globals (Triton resolves a kernel's callees through its function's globals).
    ``kernel``: the kernel to return, or the name of a plain function of this script to make into
    one over the same globals (``_split_fwd_kernel``)."""
    glb = dict(kernels_module.__dict__)
    glb.update(replace)
    for name in _FORWARD_TREE:
        if name in replace:
            continue
        glb[name] = triton.jit(_remade(getattr(kernels_module, name).fn, glb))
    if kernel not in glb:
        glb[kernel] = triton.jit(_remade(globals()[kernel], glb))
    return glb[kernel]


def _split_fwd_kernel(X, R, W, Y, RO, RSTD, stride_x, stride_r, stride_y, stride_ro, n_rows, n_cols,
                     eps: "fp64", ROWS_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr,
                     SINGLE_BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_RESIDUAL_OUT: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, CAST_HF: tl.constexpr, STORE_RSTD: tl.constexpr,
                     CD: tl.constexpr, SPLIT: tl.constexpr):
    """dsnorm's forward (its parameters; a single block and one row a program only) with each row
    spread over SPLIT programs, grid (rows, SPLIT): every one of them loads the whole row and sums it
    exactly as dsnorm does (the same layout, so the same rstd bits), then loads the weight for, and
    stores, only its own BLOCK_N / SPLIT columns. At decode one program's loads pass through one SM;
    this moves the weight's bytes (half of a fused [1, 7168] row's) and the stores onto SPLIT SMs.
    Out of place only: a program storing y into x while another still reads x would race.

    A plain function: make_variants makes it a jit function over the library kernels module's
    globals, where its helpers (``_load_s``...) are found, as the interpreter also looks them up."""
    tl.static_assert(SINGLE_BLOCK and ROWS_PER_PROG == 1 and BLOCK_N >= SPLIT, "decode shapes only")
    row64 = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * (BLOCK_N // SPLIT)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    mine = mask & (cols >= lo) & (cols < lo + BLOCK_N // SPLIT)
    s = _load_s(X + row64 * stride_x + cols, R + row64 * stride_r + cols, mask, HAS_RESIDUAL, ROUND_FIRST,
                X.dtype.element_ty, CD)
    w = tl.load(W + cols, mask=mine, other=0.0).to(CD)
    if HAS_RESIDUAL_OUT:
        tl.store(RO + row64 * stride_ro + cols, _narrow(s, RO.dtype.element_ty), mask=mine)
    rstd = _rstd(_row_sum(s * s), n_cols, eps, CD)
    if STORE_RSTD:
        tl.store(RSTD + row64, rstd.to(RSTD.dtype.element_ty), mask=lo == 0)
    y = _scale(s * rstd, w, Y.dtype.element_ty, CAST_HF, CD)
    tl.store(Y + row64 * stride_y + cols, y, mask=mine)


def make_variants(kernels) -> dict:
    """name -> (forward kernel, split): dsnorm's own, the same with a jit helper replaced, and the
    row spread over ``split`` programs (module doc)."""
    from triton.language.extra import libdevice

    @triton.jit
    def approx_rstd(sumsq, n_cols, eps, CD: tl.constexpr):
        # All in fp32 (eps arrives as fp64): Triton's fp32 division and the hardware's rsqrt.
        return tl.math.rsqrt(sumsq / (n_cols * tl.full([], 1.0, CD)) + tl.full([], eps, CD))

    @triton.jit
    def rcp_rstd(sumsq, n_cols, eps, CD: tl.constexpr):
        # The same bits as dsnorm's (both IEEE-rounded), the reciprocal as rcp.rn instead of div.rn.
        var = kernels._mean(sumsq, n_cols, CD) + tl.full([], eps, CD)
        return libdevice.rcp_rn(tl.math.sqrt_rn(var))

    @triton.jit
    def pair_widen(v, CD: tl.constexpr):
        # bf16 -> fp32 two values at a time from their 32-bit word: the low one shifted up, the high
        # one masked in place (one instruction each). ptxas makes three of a pair's widening through
        # cvt.f32.bf16 (the high half moved down by a PRMT, then shifted back up). Exact either way:
        # the same bits as dsnorm's.
        if v.dtype == tl.bfloat16:
            out = tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xffff0000;", "=r,=r,r", [v],
                                            dtype=tl.float32, is_pure=True, pack=2).to(CD)
        else:
            out = v.to(CD)
        return out

    split = _rejit(kernels, {}, "_split_fwd_kernel")
    return {"dsnorm": (kernels.rms_norm_fwd_kernel, 1), "approx rstd": (_rejit(kernels, {"_rstd": approx_rstd}), 1),
            "rcp_rn rstd": (_rejit(kernels, {"_rstd": rcp_rstd}), 1),
            "pair widen": (_rejit(kernels, {"_widen": pair_widen}), 1),
            "pair+rcp_rn": (_rejit(kernels, {"_widen": pair_widen, "_rstd": rcp_rstd}), 1),
            "split 2": (split, 2), "split 4": (split, 4), "fma sumsq": (kernels.rms_norm_fwd_kernel, 1)}


def launch_variant(kernel, split: int, grid, args, meta):
    """A variant's launch: the library's own grid and meta, or with ``split`` > 1 the split
    kernel's grid (rows, split) and its SPLIT."""
    if split == 1:
        return kernel[grid](*args, **meta)
    return kernel[(grid[0], split)](*args, **meta, SPLIT=split)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a dsnorm/triton/kernels.py of another revision to A/B against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu_decode.py: no CUDA device", file=sys.stderr)
        return 2

    from dsnorm.bench.timing import graph_replay_time
    from dsnorm.bench.verify import ulp_distance
    from dsnorm.triton import kernels, launch

    variants = make_variants(kernels)
    if args.baseline:
        spec = importlib.util.spec_from_file_location("dsnorm_baseline_kernels", args.baseline)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        variants["baseline"] = (old.rms_norm_fwd_kernel, 1)
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        LigerRMSNormFunction = None
        print(f"not measured: liger: {e}")

    torch.set_grad_enabled(False)  # Liger's Functions then build no autograd graph
    out_rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}; "
          f"us per call from CUDA graphs of 200 calls, {args.rounds} interleaved rounds")
    for label, m, n, stride, fused in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(m * n)
        width = stride or n
        x = torch.randn(m, width, device="cuda", generator=g).bfloat16()[:, :n]
        r = (4 * torch.randn(m, n, device="cuda", generator=g)).bfloat16() if fused else None
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).float()
        outs, calls = {}, {}
        for name, (kernel, split) in variants.items():
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            ro = torch.empty_like(y) if fused else None
            grid, kargs, meta = launch.forward_params(x, r, w, EPS, False, False, y, ro, None)
            meta = {**meta, **OPTIONS.get(name, {})}
            calls[name] = (lambda k=kernel, sp=split, gr=grid, a=kargs, mt=meta: launch_variant(k, sp, gr, a, mt))
            calls[name]()
            outs[name] = (y, ro)
        if LigerRMSNormFunction is not None:
            if fused:
                calls["liger"] = lambda: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False)
            else:
                calls["liger"] = lambda: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False, None)
            liger_y = calls["liger"]()
            outs["liger"] = (liger_y[0], liger_y[1]) if fused else (liger_y, None)
        torch.cuda.synchronize()
        ref_y, ref_ro = outs["dsnorm"]
        notes = {}
        for name, (y, ro) in outs.items():
            if name == "dsnorm":
                continue
            differ = 100 * (y != ref_y).float().mean().item()
            notes[name] = f"y max {int(ulp_distance(y, ref_y).max())} ulp, {differ:.2f}% differ" + (
                f"; residual_out bitwise {torch.equal(ro, ref_ro)}" if fused else "")
            if name not in NOT_BITWISE and not (torch.equal(y, ref_y) and (ro is None or torch.equal(ro, ref_ro))):
                notes[name] += "  NOT dsnorm's bits: this variant must give them"
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, fn in calls.items():
                times[name].append(graph_replay_time(fn, calls=200, reps=10) * 1e6)
        base = statistics.median(times["dsnorm"])
        for name, ts in times.items():
            med = statistics.median(ts)
            row = dict(case=label, M=m, N=n, variant=name, median_us=med, min_us=min(ts), vs_dsnorm=med / base,
                       note=notes.get(name, ""))
            out_rows.append(row)
            print(f"{label:20s} {name:12s} median {med:6.3f} us  min {min(ts):6.3f} us  x{med / base:5.3f}  "
                  f"{row['note']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out_rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
