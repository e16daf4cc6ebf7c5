"""The fusions' Triton kernels run through Triton's interpreter on CPU tensors, against the reference.

The interpreter is switched on exactly as in ``test_triton_interpret.py``: ``TRITON_INTERPRET=1``
before the first ``import triton`` (then for the rest of the process), or, when ``triton`` was
already imported compiled, ``dsnorm.triton.kernels`` and ``dsnorm.triton.fusions`` are reloaded
under the variable (kernels first: the fusions call its helpers), which is then restored, and both
are reloaded compiled after these tests.

Criteria (the GPU's): residual bitwise; y within one ulp (fp32: 4e-6 relative), the freedom
being the order of the sum of squares; the quantisation exact *given y*: q and scales bitwise equal
to ``act_quant_ref`` applied to the kernel's own y. Against ``act_quant_ref`` of the reference's y
the q / scale mismatches are counted and must sit only in blocks where y itself differs.
A last test compiles the kernels ahead of time for sm_90 (front end, and IEEE div/sqrt in PTX).
"""

import importlib
import os
import textwrap

import pytest
import torch

from triton_interpreter import interpreted_triton, ptxas_available, restore_interpret, run_compiled  # noqa: E402

triton, _PRIOR_INTERPRET, _TRITON_PREIMPORTED = interpreted_triton()
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from dsnorm.triton import fusions as tfusions  # noqa: E402
from dsnorm.triton import kernels, launch  # noqa: E402

if not isinstance(kernels.rms_norm_fwd_kernel, InterpretedFunction):
    kernels = importlib.reload(kernels)
if not isinstance(tfusions.rms_norm_fp8_kernel, InterpretedFunction):
    tfusions = importlib.reload(tfusions)


@triton.jit
def _e4m3_kernel(F32_IN, U8_OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(U8_OUT + offs, tfusions.e4m3_bits(tl.load(F32_IN + offs, mask=mask, other=0.0)), mask=mask)


@triton.jit
def _scales_kernel(F32_IN, F32_OUT, NB: tl.constexpr, QBLOCK: tl.constexpr, UE8M0: tl.constexpr):
    # F32_IN: [NB, QBLOCK] blocks -> F32_OUT: [NB] scales
    offs = tl.arange(0, NB)[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    tl.store(F32_OUT + tl.arange(0, NB), tfusions.block_scales(tl.load(F32_IN + offs), UE8M0))


if _TRITON_PREIMPORTED:
    restore_interpret(_PRIOR_INTERPRET)

from dsnorm import fusions  # noqa: E402
from dsnorm.fusions import act_quant_ref  # noqa: E402
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reload(modules, interpret: bool) -> None:
    prior = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        for module in modules:
            importlib.reload(module)
    finally:
        restore_interpret(prior)


@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels():
    """Interpreted kernels for these tests, and afterwards the state found before them: another
    module's teardown may have reloaded them compiled since collection, and another module that
    runs next may expect the interpreted ones it set up at its own collection."""
    found = [(m, isinstance(getattr(m, attr), InterpretedFunction))
             for m, attr in ((kernels, "rms_norm_fwd_kernel"), (tfusions, "rms_norm_fp8_kernel"))]
    if not all(interpreted for _, interpreted in found):
        assert _TRITON_PREIMPORTED, "kernels compiled in an interpreted process"
        _reload([kernels, tfusions], True)
    assert isinstance(kernels.rms_norm_fwd_kernel, InterpretedFunction), "kernels are not interpreted"
    assert isinstance(tfusions.rms_norm_fp8_kernel, InterpretedFunction), "kernels are not interpreted"
    yield
    _reload([m for m, interpreted in found if not interpreted], False)


# ---------------------------------------------------------------------------------------------
# Helpers.


def _ordered(t: torch.Tensor) -> torch.Tensor:
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16)
    i = t.contiguous().view(bits).to(torch.int64)
    sign_bit = 1 << (torch.iinfo(bits).bits - 1)
    return torch.where(i < 0, -(i + sign_bit), i)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise ulp distance (0 where both are NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    d = (_ordered(a) - _ordered(b)).abs()
    return torch.where(a.isnan() & b.isnan(), torch.zeros_like(d), d)


def assert_bitwise(a, b):
    assert ulps(a, b).max() == 0 if a.numel() else True
    assert torch.equal(a.isnan(), b.isnan())


def assert_close_y(y, ref):
    assert torch.equal(y.isnan(), ref.isnan())
    if y.dtype == torch.float32:
        keep = ~ref.isnan() & ~ref.isinf()
        err = (y[keep] - ref[keep]).abs()
        assert bool((err <= 4e-6 * ref[keep].abs()).all())
    elif y.dtype == torch.float64:
        torch.testing.assert_close(y, ref, rtol=1e-14, atol=0)
    else:
        assert int(ulps(y, ref).max()) <= 1


def assert_y_at_a_nearby_rstd(y, s, w, max_ulps=4):
    """Each row of ``y`` is the reference's formula ``(w * (s * rstd)).to(y.dtype)`` at an rstd
    within ``max_ulps`` fp32 ulps of the reference's own ``rsqrt(mean(s^2) + eps)``: the one freedom
    a kernel has is the order of its sum of squares, which moves rstd only. Where y is held to one
    ulp this still tells the residual modes apart: normalising the rounded sum changes s itself,
    which no rstd makes up for (on bf16 data, 2-25% of y's elements change)."""
    s2, y2 = s.float().reshape(-1, s.shape[-1]), y.reshape(-1, y.shape[-1])
    rstd = torch.rsqrt(s2.pow(2).mean(-1) + EPS)
    steps = torch.arange(-max_ulps, max_ulps + 1)[:, None]
    stepped = (rstd.view(torch.int32)[None, :] + steps.to(torch.int32)).view(torch.float32)
    finite = torch.isfinite(rstd) & (rstd > 0)
    candidates = torch.where(finite[None, :], stepped, rstd[None, :])  # [2k+1, rows]
    want = (w.float() * (s2[None] * candidates[..., None])).to(y.dtype)
    same = ulps(want, y2.expand_as(want).contiguous()) == 0
    matched = same.all(-1).any(0)
    assert bool(matched.all()), f"rows {matched.logical_not().nonzero().flatten().tolist()} match no nearby rstd"


def fp8_equal(a, b) -> bool:
    ab, bb = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (ab & 0x7F) == 0x7F, (bb & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(ab[~nan_a], bb[~nan_b])


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def block_weight(n, gen, block=128):
    scales = torch.tensor([2.0 ** k for k in range(-24, 13, 3)] + [0.0, 1e-5, 448.0, 1.0], dtype=torch.float64)
    per_block = scales[torch.arange(n // block) % len(scales)]
    return ((1.0 + 0.25 * torch.randn(n, generator=gen, dtype=torch.float64)) * per_block.repeat_interleave(block)).float()


# ---------------------------------------------------------------------------------------------
# The conversions, one launch each.


def test_e4m3_conversion():
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF], dtype=torch.int64)
    v = (hi[:, None] | lows[None, :]).flatten().to(torch.int32).view(torch.float32).contiguous()
    out = torch.empty(v.numel(), dtype=torch.uint8)
    block = 1 << 16
    _e4m3_kernel[(triton.cdiv(v.numel(), block),)](v, out, v.numel(), BLOCK=block)
    want = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert int(v.isnan().sum()) > 1000
    assert torch.equal(out, want), f"{int((out != want).sum())} differ"


@pytest.mark.parametrize("ue8m0", [False, True])
def test_block_scales(ue8m0):
    # Blocks whose amax is the floor, an exact power of two, a power of two times 448 and its
    # neighbours, random, inf and NaN: scales bitwise equal to the reference's.
    nb, qb = 64, 16
    gen = torch.Generator().manual_seed(1)
    x = randn((nb, qb), torch.float32, gen)
    special = torch.tensor([0.0, 1e-6, 1.0, 448.0, 2 * 448.0, 2.0**-10 * 448, 3.0e38, float("inf"), float("nan")])
    k = len(special)
    x[: 2 * k] *= 1e-3  # the special value is the block's amax
    x[:k, 3] = special
    x[k: 2 * k, 5] = torch.nextafter(special * 448, torch.tensor(float("inf")))
    x[2 * k:] *= (2.0 ** torch.arange(-23, 23).float())[:, None]  # 46 binades
    x[0] = 0.0
    out = torch.empty(nb)
    _scales_kernel[(1,)](x, out, NB=nb, QBLOCK=qb, UE8M0=ue8m0)
    _, want = act_quant_ref(x, qb, "ue8m0" if ue8m0 else None)
    assert_bitwise(out, want.view(-1))


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


def _run_fp8(x, r, w, fmt, block=128, store_y=True):
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(*x.shape[:-1], x.shape[-1] // block)
    y = torch.empty(x.shape, dtype=x.dtype) if store_y else None
    ro = None if r is None else torch.empty(x.shape, dtype=x.dtype)
    tfusions.rms_norm_fp8(x, r, w, EPS, fmt == "ue8m0", block, y, ro, q, s)
    return q, s, ro, y


def _check_fp8(x, r, w, fmt, block=128):
    q, s, ro, y = _run_fp8(x, r, w, fmt, block)
    if r is None:
        y_ref = rms_norm_ref(x, w, EPS)
    else:
        y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS)
        assert_bitwise(ro, ro_ref)
    assert_close_y(y, y_ref)
    assert_y_at_a_nearby_rstd(y, x.float() if r is None else x.float() + r.float(), w)
    # Exact given y.
    q_y, s_y = act_quant_ref(y, block, fmt)
    assert fp8_equal(q, q_y) and (torch.equal(s, s_y) or bool(((s == s_y) | (s.isnan() & s_y.isnan())).all()))
    # Against the reference's y: mismatches only in blocks where y differs (counted, not hidden).
    q_r, s_r = act_quant_ref(y_ref, block, fmt)
    y_diff_blocks = (ulps(y, y_ref) > 0).unflatten(-1, (-1, block)).any(-1)
    s_diff = (s != s_r) & ~(s.isnan() & s_r.isnan())
    qa, qr = q.view(torch.uint8), q_r.view(torch.uint8)
    both_nan = ((qa & 0x7F) == 0x7F) & ((qr & 0x7F) == 0x7F)  # a NaN's sign is not specified
    q_diff = ((qa != qr) & ~both_nan).unflatten(-1, (-1, block)).any(-1)
    assert not bool((s_diff & ~y_diff_blocks).any()) and not bool((q_diff & ~y_diff_blocks).any())
    # Without y stored: the same q and scales.
    q2, s2, _, _ = _run_fp8(x, r, w, fmt, block, store_y=False)
    assert fp8_equal(q2, q) and torch.equal(s2.view(torch.int32), s.view(torch.int32))
    return int(q_diff.sum()), int(s_diff.sum())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,stride", [(2, 1536, None), (2, 7168, None), (3, 512, 576)])
def test_fp8_forward(dtype, rows, n, stride):
    gen = torch.Generator().manual_seed(n + rows)
    x = randn((rows, stride or n), dtype, gen)[:, :n]
    r = randn((rows, n), dtype, gen, 4.0)
    w = block_weight(n, gen)
    fmt = "ue8m0" if n != 1536 else None
    _check_fp8(x, r, w, fmt)
    _check_fp8(x, None, w, "ue8m0" if fmt is None else None)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp8_extremes():
    n = 256
    gen = torch.Generator().manual_seed(5)
    x = randn((4, n), torch.bfloat16, gen)
    x[0, 3] = float("nan")
    x[1] = 0.0
    x[2, 140] = 50.0
    w = block_weight(n, gen)
    w[140] = 3e38
    w[200] = float("nan")
    for fmt in (None, "ue8m0"):
        _check_fp8(x, None, w, fmt)


def test_fp8_multi_block(monkeypatch):
    # Rows wider than one block: the two-pass path, 2 and 4 chunks of BLOCK_N = 128 columns.
    monkeypatch.setattr(launch, "MAX_BLOCK_N", 64)
    assert not tfusions.fp8_config(512, torch.bfloat16, 128)[2]
    assert not tfusions.fp8_config(512, torch.bfloat16, 32)[2]
    gen = torch.Generator().manual_seed(6)
    x, r = randn((2, 512), torch.bfloat16, gen), randn((2, 512), torch.bfloat16, gen)
    _check_fp8(x, r, block_weight(512, gen), "ue8m0", 128)
    _check_fp8(x, r, block_weight(512, gen, 32), None, 32)


def test_fp8_public_api_on_the_triton_launchers(monkeypatch):
    # The op stack (checks, N-D and strided rows) as CUDA tensors would use it.
    monkeypatch.setitem(fusions._fusion_launchers, "cpu", tfusions)
    gen = torch.Generator().manual_seed(7)
    x = randn((2, 2, 576), torch.bfloat16, gen)[..., :512]
    r = randn((2, 2, 512), torch.bfloat16, gen)
    w = block_weight(512, gen)
    q, s, ro, y = fusions.fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0", return_normed=True)
    y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w)
    assert_bitwise(ro, ro_ref)
    assert_close_y(y, y_ref)
    assert_y_at_a_nearby_rstd(y, x.float() + r.float(), w)
    q_y, s_y = act_quant_ref(y, 128, "ue8m0")
    assert fp8_equal(q, q_y) and torch.equal(s, s_y)
    q1, s1 = fusions.rms_norm_fp8(x, w)
    assert fp8_equal(q1, act_quant_ref(fusions.rms_norm_fp8(x, w, return_normed=True)[2], 128)[0])


# ---------------------------------------------------------------------------------------------
# Final norm and MLA latents.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_final_norm_lengths(dtype):
    gen = torch.Generator().manual_seed(8)
    batch, seq, n = 3, 5, 7168 if dtype == torch.bfloat16 else 300
    h = randn((seq, batch, n), dtype, gen).transpose(0, 1)  # [B, T, n] view, strided
    r = randn((batch, seq, n), dtype, gen, 4.0)
    w = randn((n,), torch.float64 if dtype == torch.float64 else torch.float32, gen)
    lengths = torch.tensor([5, 1, 3])
    y, ro = torch.empty(batch, n, dtype=dtype), torch.empty(batch, n, dtype=dtype)
    tfusions.final_norm_lengths(h, r, w, EPS, lengths, y, ro)
    y_ref, ro_ref = fused_add_rms_norm_ref(h, r, w, EPS)
    rows = torch.arange(batch)
    assert_bitwise(ro, ro_ref[rows, lengths - 1])
    assert_close_y(y, y_ref[rows, lengths - 1])
    if dtype != torch.float64:  # fp64 is computed in fp64: no fp32 rstd to step
        assert_y_at_a_nearby_rstd(y, (h.float() + r.float())[rows, lengths - 1], w)


def test_final_norm_width_one_with_any_last_stride():
    # h [B, T, 1] whose last-dim stride is not 1 (only column 0 is read): it runs, not an assertion.
    gen = torch.Generator().manual_seed(5)
    h = randn((1, 3, 2), torch.bfloat16, gen).permute(2, 1, 0)  # [2, 3, 1], strides (1, 2, 6)
    r = randn((2, 3, 1), torch.bfloat16, gen)
    assert h.shape == (2, 3, 1) and h.stride(2) != 1
    w = randn((1,), torch.float32, gen)
    y, ro = torch.empty(2, 1, dtype=torch.bfloat16), torch.empty(2, 1, dtype=torch.bfloat16)
    tfusions.final_norm_lengths(h, r, w, EPS, torch.tensor([3, 2]), y, ro)
    y_ref, ro_ref = fused_add_rms_norm_ref(h, r, w, EPS)
    assert_bitwise(ro, ro_ref[torch.arange(2), torch.tensor([2, 1])])
    assert_close_y(y, y_ref[torch.arange(2), torch.tensor([2, 1])])


def test_final_norm_public_api_on_the_triton_launchers(monkeypatch):
    from dsnorm import ops

    monkeypatch.setitem(ops._launchers, "cpu", launch)
    monkeypatch.setitem(fusions._fusion_launchers, "cpu", tfusions)
    gen = torch.Generator().manual_seed(9)
    h, r = randn((2, 4, 1536), torch.bfloat16, gen), randn((2, 4, 1536), torch.bfloat16, gen)
    w = randn((1536,), torch.float32, gen)
    y_ref, ro_ref = fused_add_rms_norm_ref(h, r, w, EPS)
    y, ro = fusions.final_norm(h, r, w)  # no lengths: the core kernel on the strided h[:, -1] rows
    assert_bitwise(ro, ro_ref[:, -1])
    assert_close_y(y, y_ref[:, -1])
    lengths = torch.tensor([2, 4], dtype=torch.int32)
    y, ro = fusions.final_norm(h, r, w, lengths=lengths)
    assert_bitwise(ro, ro_ref[torch.arange(2), lengths.long() - 1])
    assert_close_y(y, y_ref[torch.arange(2), lengths.long() - 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_latent_norms(dtype):
    gen = torch.Generator().manual_seed(10)
    rows = 3
    q = randn((rows, 1536), dtype, gen)
    kv_a = randn((rows, 576), dtype, gen)
    before = kv_a.clone()
    wq, wkv = randn((1536,), torch.float32, gen), randn((512,), torch.float32, gen)
    qn, kvn = torch.empty_like(q), torch.empty(rows, 512, dtype=dtype)
    tfusions.mla_latent_norms(q, kv_a, wq, wkv, EPS, qn, kvn)
    assert_close_y(qn, rms_norm_ref(q, wq, EPS))
    assert_close_y(kvn, rms_norm_ref(kv_a[:, :512], wkv, EPS))
    assert torch.equal(kv_a.view(torch.uint8), before.view(torch.uint8))  # kv_a, rotary columns included, untouched
    # The same arithmetic as the core kernel's launches, one row kind per program.
    q1, kv1 = torch.empty_like(q), torch.empty(rows, 512, dtype=dtype)
    launch.forward(q, None, wq, EPS, False, False, q1, None, None)
    launch.forward(kv_a[:, :512], None, wkv, EPS, False, False, kv1, None, None)
    assert_bitwise(qn, q1)
    assert_bitwise(kvn, kv1)


def test_mla_multi_block_and_api(monkeypatch):
    monkeypatch.setattr(launch, "MAX_BLOCK_N", 64)  # both widths take the two-pass path
    monkeypatch.setitem(fusions._fusion_launchers, "cpu", tfusions)
    monkeypatch.setattr(fusions, "_mla_lane", lambda *args: None)  # else the CPU's MLA lane takes the call
    launches = []
    mla = tfusions.mla_latent_norms
    monkeypatch.setattr(tfusions, "mla_latent_norms", lambda *args: launches.append(1) or mla(*args))
    gen = torch.Generator().manual_seed(11)
    q = randn((2, 3, 200), torch.bfloat16, gen)
    kv_a = randn((2, 3, 100), torch.bfloat16, gen)
    wq, wkv = randn((200,), torch.float32, gen), randn((72,), torch.float32, gen)
    qn, kvn = fusions.mla_latent_norms(q, kv_a, wq, wkv)
    assert launches == [1] and kvn.shape == (2, 3, 72)  # the Triton kernel ran
    assert_close_y(qn, rms_norm_ref(q, wq, EPS))
    assert_close_y(kvn, rms_norm_ref(kv_a[..., :72], wkv, EPS))


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation for sm_90 (what the interpreter cannot check).

COMPILE_SCRIPT = textwrap.dedent(
    r"""
    import sys
    import torch
    from dsnorm.triton import fusions as tf, launch
    from triton_aot import compile_launch, rows

    def compile_checked(kernel, args, meta):
        k = compile_launch(kernel, args, meta)
        ptx = k.asm["ptx"]
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, kernel.fn.__name__
        assert "div.full.f32" not in ptx and "div.approx" not in ptx and "sqrt.approx" not in ptx
        assert "fma.rn.f32" not in ptx, kernel.fn.__name__  # every square rounded, as the reference's
        print("ok", kernel.fn.__name__, meta, file=sys.stderr)

    for r, n, dtype, res, ue, store_y, max_block in [(4, 7168, torch.bfloat16, True, True, False, None),
                                                     (1, 1536, torch.float16, False, False, True, None),
                                                     (3, 512, torch.float32, True, False, True, 64)]:
        launch.MAX_BLOCK_N = max_block or 8192
        x = rows(r, n, dtype, 576 if n == 512 else None)
        q, s = torch.empty(r, n, dtype=torch.float8_e4m3fn), torch.empty(r, n // 128)
        _, args, meta = tf.rms_norm_fp8_params(x, x.clone() if res else None, torch.ones(n), 1e-6, ue, 128,
                                               x.clone() if store_y else None, x.clone() if res else None, q, s)
        compile_checked(tf.rms_norm_fp8_kernel, args, meta)
    launch.MAX_BLOCK_N = 8192
    h = torch.zeros(3, 5, 7168, dtype=torch.bfloat16)
    _, args, meta = tf.final_norm_params(h, h.clone(), torch.ones(7168), 1e-6, torch.ones(3, dtype=torch.int64),
                                         torch.empty(3, 7168, dtype=torch.bfloat16), torch.empty(3, 7168, dtype=torch.bfloat16))
    compile_checked(tf.final_norm_kernel, args, meta)
    q, kv = rows(4, 1536, torch.bfloat16), rows(4, 512, torch.bfloat16, 576)
    _, args, meta = tf.mla_params(q, kv, torch.ones(1536), torch.ones(512), 1e-6, q.clone(), kv.contiguous())
    compile_checked(tf.mla_latent_norms_kernel, args, meta)
    print("ALL OK")
    """
)


@pytest.mark.skipif(not ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not available")
def test_fusion_kernels_compile_for_sm90():
    run_compiled(COMPILE_SCRIPT)


# Kills: _quant_store's scale mask `blocks <= n_cols // QBLOCK`. At widths that are not a power of
# two (1536, 7168: BLOCK_N 2048, 8192) each row wrote one extra scale into the next row's first
# slot, and the last row past the end of the buffer. The interpreter runs programs in order, so
# the next row overwrote it and the row-by-row comparisons saw nothing; on a GPU it is a race.
@pytest.mark.parametrize("n", [1536, 7168])
def test_fp8_scales_stay_inside_their_rows(n):
    rows, nb = 3, n // 128
    gen = torch.Generator().manual_seed(n)
    x, w = randn((rows, n), torch.bfloat16, gen), block_weight(n, gen)
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn)
    buf = torch.full((rows * nb + 8,), 123.0)
    s = buf[: rows * nb].view(rows, nb)
    for r in range(rows - 1, -1, -1):  # last row first: a spill into the next row now survives
        tfusions.rms_norm_fp8(x[r:r + 1], None, w, EPS, False, 128, None, None, q[r:r + 1], s[r:r + 1])
    assert bool((buf[rows * nb:] == 123.0).all())
    full = torch.empty_like(s)
    tfusions.rms_norm_fp8(x, None, w, EPS, False, 128, None, None, torch.empty_like(q), full)
    assert torch.equal(s, full)
