"""The Triton kernels compile for a real GPU (Hopper, sm_90) without one: ahead of time, to PTX and
cubin, with the bundled ptxas.

The interpreter (test_triton_interpret.py) checks the arithmetic but not what only the compiler
sees: that every variant type-checks in Triton's front end (e.g. ``n == 1`` arrives as the
constexpr 1, which the interpreter never does), and that the fp32 division and square root are the
IEEE-rounded instructions (``div.rn.f32``, ``sqrt.rn.f32``) and not the approximate ones the
interpreter cannot tell apart. The launches compiled are the launchers' own (``forward_params`` /
``backward_params`` on CPU tensors), specialised the way Triton's runtime does (ints equal to 1 as
constexprs; 16-divisible ints and 16-byte-aligned pointers marked divisible).

Runs in a subprocess so that Triton is imported compiled even when the interpreter module ran in
this process.
"""

import textwrap

import pytest
from triton_interpreter import ptxas_available, run_compiled

triton = pytest.importorskip("triton", reason="triton is not installed (the GPU extra: pip install dsnorm[gpu])")

# What both compile scripts begin with: the imports and the PTX checks of every compiled kernel.
PRELUDE = textwrap.dedent(
    r"""
    import re
    import sys
    import torch
    from dsnorm.triton import kernels, launch
    from triton_aot import compile_launch, rows

    assert not kernels.BIT_ARITHMETIC  # compiled: the hardware's conversions, not the interpreter's bit arithmetic

    # eps reaches every kernel as a double (the runtime honours the "fp64" annotation only when it is
    # not stringified by `from __future__ import annotations`): fp64 rows need the caller's eps.
    from dsnorm.triton import fusions as tf
    for k in (kernels.rms_norm_fwd_kernel, tf.rms_norm_fp8_kernel, tf.final_norm_kernel, tf.mla_latent_norms_kernel):
        assert [p.annotation_type for p in k.params if p.name == "eps"] == ["fp64"], k.fn.__name__

    def check(k, what, forward, fp="f32", bf16=False):
        ptx = k.asm["ptx"]
        assert f"div.rn.{fp}" in ptx and (f"sqrt.rn.{fp}" in ptx) == forward, what  # the backward loads rstd
        # bf16 stores round with the hardware's round-to-nearest-even conversion (one per 2 values)
        assert ("cvt.rn.bf16x2.f32" in ptx or "cvt.rn.bf16.f32" in ptx) == bf16, what
        assert "div.full.f32" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx, what
        assert not re.search(r"\b(atom|red)\.", ptx), what  # no atomics anywhere: dweight is deterministic
        # The forward rounds every square as the reference does: no multiply-add contracted into an
        # fma (launch.FWD_OPTIONS); the backward may contract (its criterion is a tolerance).
        assert not (forward and re.search(r"\bfma\.rn\.f(32|64)", ptx)), what
        if fp == "f64":  # the mean divides by n widened to fp64 (fp32 is inexact above 2**24 columns)
            assert "cvt.rn.f64.s32" in ptx and "cvt.rn.f32.s32" not in ptx, what
        print("ok", what, file=sys.stderr)
    """
)

SCRIPT = PRELUDE + textwrap.dedent(
    r"""
    cases = [
        # (rows, n, stride, dtype, residual dtype or None, cast_hf, round_first, max_block)
        (4, 7168, None, torch.bfloat16, torch.bfloat16, False, False, None),
        (4, 512, 576, torch.bfloat16, torch.float32, True, True, None),
        (1, 1, None, torch.float16, torch.float16, False, True, None),
        (4, 1536, None, torch.float32, None, False, False, None),
        (3, 200, None, torch.bfloat16, torch.bfloat16, False, True, 64),
        (2, 300, None, torch.float64, torch.float32, False, False, None),
    ]
    for r, n, stride, dtype, rdtype, hf, rf, max_block in cases:
        if max_block:
            launch.MAX_BLOCK_N = max_block
        w = torch.ones(n, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        fp = "f64" if dtype == torch.float64 else "f32"
        x, y = rows(r, n, dtype, stride), rows(r, n, dtype, stride)
        res = None if rdtype is None else rows(r, n, rdtype, stride)
        ro = None if rdtype is None else rows(r, n, rdtype, stride)
        _, args, meta = launch.forward_params(x, res, w, 1e-6, hf, rf, y, ro, torch.empty(r, dtype=w.dtype))
        bf16 = torch.bfloat16 in (dtype, rdtype)
        check(compile_launch(kernels.rms_norm_fwd_kernel, args, meta), f"fwd {r}x{n} {dtype} {rdtype}", True, fp, bf16)
        dro = None if rdtype is None else rows(r, n, rdtype, stride)
        # dresidual written only for a residual of another dtype (along a chain of fused norms
        # the Functions hand dx to both; the op writes both, HAS_DR on, as in the blocks below).
        dres = None if rdtype in (None, dtype) else rows(r, n, rdtype, stride)
        partials = launch.backward_partials(x, fused=res is not None)
        _, args, meta = launch.backward_params(rows(r, n, dtype, stride), x, res, w, torch.ones(r, dtype=w.dtype), dro, rf,
                                               rows(r, n, dtype, stride), dres, partials)
        assert meta["HAS_DR"] == (dres is not None)
        check(compile_launch(kernels.rms_norm_bwd_kernel, args, meta), f"bwd {r}x{n} {dtype} {rdtype}", False, fp, bf16)
        launch.MAX_BLOCK_N = 8192

    # A residual of another dtype than x's, the stream in x's dtype (the reference's residual.float()
    # under torch.autocast): dresidual written apart, in the residual's dtype.
    for dtype, rdtype in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)):
        w = torch.ones(512)
        x, y, ro, res = rows(4, 512, dtype, 576), rows(4, 512, dtype), rows(4, 512, dtype), rows(4, 512, rdtype, 576)
        _, args, meta = launch.forward_params(x, res, w, 1e-6, False, False, y, ro, torch.empty(4))
        # bf16 stores (rounded by the hardware) only where a bf16 tensor is written: y and ro here
        check(compile_launch(kernels.rms_norm_fwd_kernel, args, meta), f"fwd mixed {dtype} {rdtype}", True, "f32",
              dtype == torch.bfloat16)
        _, args, meta = launch.backward_params(rows(4, 512, dtype), x, res, w, torch.ones(4), rows(4, 512, dtype), False,
                                               rows(4, 512, dtype), rows(4, 512, rdtype), launch.backward_partials(x, True))
        assert meta["HAS_DR"]
        check(compile_launch(kernels.rms_norm_bwd_kernel, args, meta), f"bwd mixed {dtype} {rdtype}", False, "f32",
              torch.bfloat16 in (dtype, rdtype))

    print("ALL OK")
    """
)


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_kernels_compile_for_sm90():
    run_compiled(SCRIPT)


STAGES_SCRIPT = PRELUDE + textwrap.dedent(
    r"""
    from conftest import load_benchmark

    # benchmarks/bwd_stages.py, the pipelined backward (the library's launcher passes NUM_STAGES=1):
    # from 2 stages Triton issues the row loads as asynchronous copies to shared memory; at 1 the
    # kernel has none.
    bwd_stages = load_benchmark("bwd_stages")
    w = torch.ones(7168)
    for stages in (1, 3):
        x = rows(4, 7168, torch.bfloat16)
        _, args, meta = bwd_stages.backward_params(rows(4, 7168, torch.bfloat16), x, None, w, torch.ones(4), None, False,
                                                   rows(4, 7168, torch.bfloat16), None,
                                                   launch.backward_partials(x, fused=False), stages)
        assert meta["NUM_STAGES"] == stages
        k = compile_launch(kernels.rms_norm_bwd_kernel, args, meta)
        assert ("cp.async" in k.asm["ptx"]) == (stages > 1), stages
        check(k, f"bwd 4x7168 plain, {stages} stages", False, "f32", True)

    # Stages are capped so that what Triton allocates (the pipelined rows, plus a layout-conversion
    # scratch when the dtypes differ) fits the smallest sm_80+ per-block limit, 99 KiB.
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    for n, xd, rd, drod, stages in [(7168, bf, None, None, 4), (7168, bf, bf, bf, 2), (7168, bf, f32, None, 2),
                                    (3584, bf, f32, None, 3), (3584, f16, f32, f32, 2), (7168, f32, f32, None, 2),
                                    (1792, f64, f32, f32, 2), (1792, f64, f64, f32, 2)]:
        w = torch.ones(n, dtype=f64 if xd == f64 else f32)
        x = rows(4, n, xd)
        res = None if rd is None else rows(4, n, rd)
        _, args, meta = bwd_stages.backward_params(rows(4, n, xd), x, res, w, torch.ones(4, dtype=w.dtype),
                                                   None if drod is None else rows(4, n, drod), False, rows(4, n, xd),
                                                   None if rd is None else rows(4, n, rd),
                                                   launch.backward_partials(x, rd is not None), 4)
        assert meta["NUM_STAGES"] == stages, (n, xd, rd, drod, meta["NUM_STAGES"])
        k = compile_launch(kernels.rms_norm_bwd_kernel, args, meta)
        assert k.metadata.shared <= 99 * 1024, (n, xd, rd, drod, stages, k.metadata.shared)
        print("ok shared", n, xd, rd, drod, stages, k.metadata.shared, file=sys.stderr)
    print("ALL OK")
    """
)


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_pipelined_backward_experiment_compiles_for_sm90():
    # benchmarks/bwd_stages.py (the backward with its row loop software-pipelined, which the library
    # does not ship) runs on a lent GPU only: that its launches compile, with the copies it is for
    # and within the shared memory a block may have, is checked here without one.
    run_compiled(STAGES_SCRIPT)


DECODE_VARIANTS_SCRIPT = textwrap.dedent(
    r"""
    import importlib.util
    import os
    import torch
    from dsnorm.triton import kernels, launch
    from triton_aot import compile_launch, rows

    # benchmarks/ is not a package: load the decode benchmark by path, as a device run would run it.
    path = os.path.join(os.environ["DSNORM_REPO"], "benchmarks", "gpu_decode.py")
    spec = importlib.util.spec_from_file_location("gpu_decode", path)
    gpu_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_decode)
    variants = gpu_decode.make_variants(kernels)
    for label, m, n, stride, fused in gpu_decode.SHAPES:
        x, y = rows(m, n, torch.bfloat16, stride), rows(m, n, torch.bfloat16)
        r = rows(m, n, torch.bfloat16) if fused else None
        ro = rows(m, n, torch.bfloat16) if fused else None
        _, args, meta = launch.forward_params(x, r, torch.ones(n), gpu_decode.EPS, False, False, y, ro, None)
        for name, (kernel, split) in variants.items():
            meta_v = dict(meta, **gpu_decode.OPTIONS.get(name, {}))
            ptx = compile_launch(kernel, args, dict(meta_v, SPLIT=split) if split > 1 else meta_v).asm["ptx"]
            what = (label, name)
            assert ("fma.rn.f32" in ptx) == (name == "fma sumsq"), what
            pair = name.startswith("pair")
            # Each variant replaces what its name says and nothing else.
            assert ("cvt.f32.bf16" not in ptx and "0xffff0000" in ptx) == pair, what
            assert ("rcp.rn" in ptx) == ("rcp_rn" in name), what
            approx = name == "approx rstd"
            assert ("rsqrt.approx" in ptx) == approx and ("sqrt.rn.f32" in ptx) != approx, what
    print("ALL OK")
    """
)


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_decode_benchmark_variants_compile_for_sm90(monkeypatch):
    # benchmarks/gpu_decode.py runs on a lent GPU only: a variant that does not compile would cost
    # device time to find out. Each must compile for sm_90 at every shape it is timed at.
    import os

    monkeypatch.setenv("DSNORM_REPO", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_compiled(DECODE_VARIANTS_SCRIPT)


SPLIT_BITS_SCRIPT = textwrap.dedent(
    r"""
    import importlib.util
    import os
    import torch
    from dsnorm.triton import kernels, launch

    assert kernels.BIT_ARITHMETIC  # interpreted
    path = os.path.join(os.environ["DSNORM_REPO"], "benchmarks", "gpu_decode.py")
    spec = importlib.util.spec_from_file_location("gpu_decode", path)
    gpu_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_decode)
    variants = gpu_decode.make_variants(kernels)
    splits = [name for name, (_, split) in variants.items() if split > 1]
    assert splits
    torch.manual_seed(0)
    for m, n, stride, fused, dtype in [(2, 7168, None, True, torch.bfloat16), (2, 512, 576, False, torch.bfloat16),
                                       (2, 111, None, True, torch.float16), (1, 1536, None, False, torch.float32)]:
        x = torch.randn(m, stride or n).to(dtype)[:, :n]
        r = (4 * torch.randn(m, n)).to(dtype) if fused else None
        w = 1 + 0.1 * torch.randn(n)
        outs = {}
        for name in ["dsnorm"] + splits:
            kernel, split = variants[name]
            y = torch.full((m, n), float("nan"), dtype=dtype)
            ro = torch.full_like(y, float("nan")) if fused else None
            rstd = torch.full((m,), float("nan"))
            grid, args, meta = launch.forward_params(x, r, w, gpu_decode.EPS, False, False, y, ro, rstd)
            gpu_decode.launch_variant(kernel, split, grid, args, meta)
            outs[name] = [t.view(torch.uint8) for t in (y, ro, rstd) if t is not None]  # bits, NaN or not
        for name in splits:
            assert all(torch.equal(a, b) for a, b in zip(outs[name], outs["dsnorm"])), (name, m, n, dtype)
    print("ALL OK")
    """
)


def test_decode_benchmark_split_variants_give_dsnorm_bits():
    # The split variants spread a row's weight loads and stores over programs that each sum the
    # whole row: under the interpreter every output (y, residual_out, rstd) must be dsnorm's bits,
    # every column written (the outputs start as NaN).
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", DSNORM_REPO=repo)
    proc = subprocess.run([sys.executable, "-c", SPLIT_BITS_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stderr[-4000:]
