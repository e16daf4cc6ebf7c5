"""The Triton kernels run through Triton's interpreter on CPU tensors, against ``dsnorm.ref``.

How the interpreter gets switched on: ``TRITON_INTERPRET`` is read when a function is *decorated*
by ``@triton.jit`` (Triton 3.9: ``triton.jit`` checks ``knobs.runtime.interpret``), not when it is
launched, and Triton's own library (``tl.standard``) is decorated when ``triton`` is first
imported. So:

* if nothing imported ``triton`` yet, this module sets ``TRITON_INTERPRET=1`` before importing it,
  for the rest of the process (Triton's library is then interpreted, and so is every kernel
  decorated later: run GPU tests in a separate pytest process, or let them be collected first);
* if ``triton`` was already imported compiled (a GPU test module collected earlier), only
  ``dsnorm.triton.kernels`` is reloaded under the variable, which is then restored, and the module
  is reloaded compiled again after these tests. That works because the kernels call nothing from
  Triton's jit library (their row sum uses their own combine function).

The interpreter differs from the GPU in the order of its sums (numpy's, not a warp tree) and, in
the backward only, in the fma contractions a compiled kernel makes (the forward launches turn them
off: launch.FWD_OPTIONS, checked in the sm_90 PTX by test_triton_compile.py): the criteria are the
GPU's (residual bitwise, y within one ulp), not loosened ones.
"""

import importlib

import pytest
import torch

from triton_interpreter import interpreted_triton, restore_interpret  # noqa: E402

triton, _PRIOR_INTERPRET, _TRITON_PREIMPORTED = interpreted_triton()
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from dsnorm.triton import kernels, launch  # noqa: E402

if not isinstance(kernels.rms_norm_fwd_kernel, InterpretedFunction):
    kernels = importlib.reload(kernels)


@triton.jit
def _bf16_convert_kernel(F32_IN, BF16_OUT, F32_ROUNDED, BF16_IN, F32_WIDE, n, BLOCK: tl.constexpr):
    # F32_IN: fp32 values to round; BF16_OUT / F32_ROUNDED: _narrow's bf16 and _round_to's fp32 of
    # them; BF16_IN: bf16 patterns to widen into F32_WIDE; n: elements; BLOCK: elements per program.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(F32_IN + offs, mask=mask, other=0.0)
    tl.store(BF16_OUT + offs, kernels._narrow(v, tl.bfloat16), mask=mask)
    tl.store(F32_ROUNDED + offs, kernels._round_to(v, tl.bfloat16, tl.float32), mask=mask)
    h = tl.load(BF16_IN + offs, mask=mask, other=0.0)
    tl.store(F32_WIDE + offs, kernels._widen(h, tl.float32), mask=mask)


if _TRITON_PREIMPORTED:
    restore_interpret(_PRIOR_INTERPRET)

from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_backward_ref, rms_norm_ref  # noqa: E402

from conftest import assert_grad_close  # noqa: E402

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels():
    assert isinstance(kernels.rms_norm_fwd_kernel, InterpretedFunction), "kernels are not interpreted"
    assert kernels.BIT_ARITHMETIC, "interpreted kernels must convert bf16 by bit arithmetic (the interpreter truncates)"
    yield
    if _TRITON_PREIMPORTED:
        importlib.reload(kernels)  # compiled again for whatever runs next


# ---------------------------------------------------------------------------------------------
# Helpers.


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits mapped to integers that count ulps (sign-magnitude -> two's complement order)."""
    if t.dtype == torch.float32:
        bits = t.view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    else:
        bits = t.view(torch.int16).to(torch.int64)
        mag = bits & 0x7FFF
    return torch.where(bits < 0, -mag, mag)


def max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan()), "NaN positions differ"
    keep = ~a.isnan()
    if not keep.any():
        return 0
    return int((_ordered(a[keep]) - _ordered(b[keep])).abs().max())


def assert_close_y(y: torch.Tensor, ref: torch.Tensor, cast: str = "deepseek"):
    """bf16/fp16: within one ulp of the reference (two with cast="hf": x̂ is rounded to the dtype
    before the weight multiply, so a 1-ulp x̂ from another sum order becomes up to 2 ulps of y);
    fp32: within 4e-6 relative, elementwise."""
    if y.dtype == torch.float32:
        assert torch.equal(y.isnan(), ref.isnan())
        keep = ~ref.isnan()
        err = (y[keep] - ref[keep]).abs()
        assert bool((err <= 4e-6 * ref[keep].abs()).all()), f"max rel err {(err / ref[keep].abs()).max()}"
    elif y.dtype == torch.float64:
        torch.testing.assert_close(y, ref, rtol=1e-14, atol=0)
    else:
        assert max_ulp(y, ref) <= (2 if cast == "hf" else 1)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor):
    """Same bits, except that a NaN only has to be a NaN: its payload is not specified (torch's
    CPU bf16 conversion gives 0xFFFF vectorised and 0x7FC0 scalar, CUDA 0x7FFF; ours 0x7FC0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), "NaN positions differ"
    a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rows_of(rows: int, n: int, dtype, gen, stride: int | None = None, scale: float = 1.0) -> torch.Tensor:
    """A [rows, n] tensor; with ``stride`` a slice of wider rows (the 512-of-576 layout)."""
    width = n if stride is None else stride
    full = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return full[:, :n]


def weight_of(n: int, gen, dtype=torch.float32) -> torch.Tensor:
    return (1.0 + 0.25 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)


def ref_rstd(s: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(s.pow(2).mean(-1) + EPS)


# Widths: n=1, odd, DeepSeek's three (512 as the strided 512-of-576 slice). Few rows: every
# interpreted launch costs tens of milliseconds.
SHAPES = [(3, 1, None), (3, 111, None), (2, 512, 576), (2, 1536, None), (2, 7168, None)]


# ---------------------------------------------------------------------------------------------
# The bf16 conversions.


def test_bf16_conversions_exact():
    # Every bf16 pattern as the kept half, with the dropped half at the interesting points: exact,
    # tie (both parities of the kept half), just below and above a tie, the smallest nonzero.
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF], dtype=torch.int64)
    patterns = (hi[:, None] | lows[None, :]).flatten()
    f32 = patterns.to(torch.int32).view(torch.float32).contiguous()  # int64 -> int32 wraps the sign bit
    n = f32.numel()
    bf16_in = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16_in = bf16_in.repeat(n // (1 << 16))
    out = torch.empty(n, dtype=torch.bfloat16)
    rounded = torch.empty(n, dtype=torch.float32)
    wide = torch.empty(n, dtype=torch.float32)
    block = 1 << 16
    _bf16_convert_kernel[(triton.cdiv(n, block),)](f32, out, rounded, bf16_in, wide, n, BLOCK=block)

    expect = f32.to(torch.bfloat16)
    nan = f32.isnan()
    assert int(nan.sum()) > 1000 and bool(f32.isinf().any())
    assert torch.equal(out[~nan].view(torch.int16), expect[~nan].view(torch.int16))
    assert bool((out[nan].view(torch.int16) == 0x7FC0).all())
    assert torch.equal(rounded[~nan].view(torch.int32), expect[~nan].float().view(torch.int32))
    assert bool(rounded[nan].isnan().all())
    # Widening is exact for every pattern, subnormals included.
    ref_wide = bf16_in.float()
    wnan = ref_wide.isnan()
    assert torch.equal(wide[~wnan].view(torch.int32), ref_wide[~wnan].view(torch.int32))
    assert torch.equal(wide[wnan].view(torch.int32), ref_wide[wnan].view(torch.int32))
    # Spot checks that the set above holds what it claims: the largest finite ties to inf.
    assert out[f32 == torch.tensor(0x7F7F8000, dtype=torch.int32).view(torch.float32)].float().isinf().all()


# ---------------------------------------------------------------------------------------------
# Forward.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,stride", SHAPES)
def test_rms_norm_forward(dtype, rows, n, stride):
    gen = torch.Generator().manual_seed(n * 7 + rows)
    x = rows_of(rows, n, dtype, gen, stride)
    w = weight_of(n, gen)
    for cast in ("deepseek", "hf"):
        y = torch.empty(rows, n, dtype=dtype)
        rstd = torch.empty(rows, dtype=torch.float32)
        launch.forward(x, None, w, EPS, cast == "hf", False, y, None, rstd)
        assert_close_y(y, rms_norm_ref(x, w, EPS, cast), cast)
        assert max_ulp(rstd, ref_rstd(x.float())) <= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,stride", SHAPES)
def test_fused_forward(dtype, rows, n, stride):
    gen = torch.Generator().manual_seed(n * 11 + rows)
    x = rows_of(rows, n, dtype, gen, stride)
    w = weight_of(n, gen)
    for res_dtype in sorted({dtype, torch.float32}, key=str):
        r = rows_of(rows, n, res_dtype, gen, stride, scale=4.0)
        for rounding in ("fp32_sum", "round_first"):
            for cast in ("deepseek", "hf"):
                y = torch.empty(rows, n, dtype=dtype)
                ro = torch.empty(rows, n, dtype=res_dtype)
                rstd = torch.empty(rows, dtype=torch.float32)
                launch.forward(x, r, w, EPS, cast == "hf", rounding == "round_first", y, ro, rstd)
                y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS, cast, rounding, res_dtype)
                assert_bitwise(ro, ro_ref)
                assert_close_y(y, y_ref, cast)
                s = x.float() + r.float()
                if rounding == "round_first":
                    s = s.to(dtype).float()
                assert max_ulp(rstd, ref_rstd(s)) <= 4


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_forward_extremes(dtype):
    # Sums that overflow x's dtype (residual_out is inf, y still finite for fp32_sum), ties in the
    # rounding of the sum, a NaN row and an all-zero row.
    n = 64
    gen = torch.Generator().manual_seed(5)
    big = torch.finfo(dtype).max
    x = rows_of(4, n, dtype, gen)
    r = rows_of(4, n, dtype, gen)
    x[0] = big
    r[0] = big
    x[1, ::2] = 1.0
    r[1, ::2] = torch.finfo(dtype).eps * 0.5  # exactly half an ulp of 1: a tie, rounds to even
    x[2, 3] = float("nan")
    x[3] = 0.0
    r[3] = 0.0
    w = weight_of(n, gen)
    for rounding in ("fp32_sum", "round_first"):
        y = torch.empty_like(x)
        ro = torch.empty_like(r)
        launch.forward(x, r, w, EPS, False, rounding == "round_first", y, ro, None)
        y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS, "deepseek", rounding)
        assert_bitwise(ro, ro_ref)
        assert max_ulp(y, y_ref) <= 1
    assert bool(ro[0].isinf().all()) and bool(y[2].isnan().all()) and bool((y[3] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_in_place(dtype):
    # y is x and residual_out is residual, both strided 512-of-576 slices of wider rows.
    rows, n, stride = 3, 512, 576
    gen = torch.Generator().manual_seed(3)
    x_parent = rows_of(rows, stride, dtype, gen)
    r_parent = rows_of(rows, stride, dtype, gen)
    x, r = x_parent[:, :n], r_parent[:, :n]
    w = weight_of(n, gen)
    for rounding in ("fp32_sum", "round_first"):
        y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS, "deepseek", rounding)
        xp, rp = x_parent.clone(), r_parent.clone()
        xi, ri = xp[:, :n], rp[:, :n]
        launch.forward(xi, ri, w, EPS, False, rounding == "round_first", xi, ri, None)
        assert_bitwise(ri, ro_ref)
        assert_close_y(xi, y_ref)
        # The wider rows' tail columns are untouched.
        assert torch.equal(xp[:, n:], x_parent[:, n:]) and torch.equal(rp[:, n:], r_parent[:, n:])
    xp = x_parent.clone()
    xi = xp[:, :n]
    launch.forward(xi, None, w, EPS, False, False, xi, None, None)
    assert_close_y(xi, rms_norm_ref(x, w, EPS))
    assert torch.equal(xp[:, n:], x_parent[:, n:])


def test_forward_rows_zero():
    # No rows: no launch (a zero-size grid is an error), nothing written, for the forward and the
    # backward, whose dweight is then zero (the sum over no rows).
    x = torch.empty(0, 7168, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    launch.forward(x, x.clone(), weight_of(7168, torch.Generator()), EPS, False, False, y, torch.empty_like(x),
                   torch.empty(0))
    assert y.shape == (0, 7168)
    dweight = torch.full((7168,), float("nan"))
    launch.backward(x, x, None, weight_of(7168, torch.Generator()), torch.empty(0), None, False, torch.empty_like(x),
                    None, dweight)
    assert bool((dweight == 0).all())


def test_width_one_rows_with_any_last_stride():
    # A [rows, 1] view of a transposed [1, rows] tensor is contiguous by torch's rule (size-1 dims
    # have no stride to keep) but its last-dim stride is rows: only column 0 is read, so it runs.
    gen = torch.Generator().manual_seed(1)
    x = rows_of(1, 4, torch.bfloat16, gen).t()
    r = rows_of(1, 4, torch.bfloat16, gen).t()
    assert x.shape == (4, 1) and x.stride() == (1, 4) and x.is_contiguous()
    w = weight_of(1, gen)
    y, ro = torch.empty(4, 1, dtype=torch.bfloat16), torch.empty(4, 1, dtype=torch.bfloat16)
    launch.forward(x, r, w, EPS, False, False, y, ro, None)
    y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS)
    assert_bitwise(ro, ro_ref)
    assert_close_y(y, y_ref)


def test_launches_make_the_tensors_device_current(monkeypatch):
    # Triton launches on the current CUDA device, not the tensors': a tensor on cuda:1 while
    # cuda:0 is current gets cuda:1 made current around the launch (checked without a GPU: the
    # context is built, not entered).
    class OnDevice:
        def __init__(self, spec):
            self.device = torch.device(spec)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = launch.on_device(OnDevice("cuda:1"))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for spec in ("cuda:0", "cuda", "cpu"):
        assert not isinstance(launch.on_device(OnDevice(spec)), torch.cuda.device)


@pytest.mark.parametrize("n", [1536, 7168])
def test_forward_batch_invariant(n):
    gen = torch.Generator().manual_seed(n)
    x = rows_of(5, n, torch.bfloat16, gen)
    r = rows_of(5, n, torch.bfloat16, gen)
    w = weight_of(n, gen)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(5)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    for i in (0, 4):
        y1, ro1, rstd1 = torch.empty_like(x[i:i + 1]), torch.empty_like(r[i:i + 1]), torch.empty(1)
        launch.forward(x[i:i + 1], r[i:i + 1], w, EPS, False, False, y1, ro1, rstd1)
        assert_bitwise(y1, y[i:i + 1])
        assert_bitwise(ro1, ro[i:i + 1])
        assert_bitwise(rstd1, rstd[i:i + 1])


@pytest.mark.parametrize("fused", [True, False])
def test_forward_rows_per_program(monkeypatch, fused):
    """Past ``FWD_MAX_PROGRAMS`` rows a program loops over a block of rows (the last one partial):
    the same bits as one row a program, which takes the kernel's straight-line branch."""
    gen = torch.Generator().manual_seed(5)
    x = rows_of(5, 1536, torch.bfloat16, gen, 1600)
    r = rows_of(5, 1536, torch.bfloat16, gen) if fused else None
    w = weight_of(1536, gen)
    outs = []
    for programs in (launch.FWD_MAX_PROGRAMS, 2):
        monkeypatch.setattr(launch, "FWD_MAX_PROGRAMS", programs)
        y, rstd = torch.empty(5, 1536, dtype=x.dtype), torch.empty(5)
        ro = torch.empty_like(y) if fused else None
        grid, _, meta = launch.forward_params(x, r, w, EPS, False, False, y, ro, rstd)
        assert (grid, meta["ROWS_PER_PROG"]) == (((5,), 1) if programs > 5 else ((2,), 3))
        launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
        outs.append((y, ro, rstd))
    for a, b in zip(*outs):
        if a is not None:
            assert_bitwise(a, b)
    assert_close_y(outs[1][0], fused_add_rms_norm_ref(x, r, w, EPS)[0] if fused else rms_norm_ref(x, w, EPS))


def test_forward_fp64():
    gen = torch.Generator().manual_seed(64)
    n = 300
    x = rows_of(3, n, torch.float64, gen)
    r = rows_of(3, n, torch.float64, gen)
    w = weight_of(n, gen, torch.float64)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(3, dtype=torch.float64)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS)
    assert_bitwise(ro, ro_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=0)
    torch.testing.assert_close(rstd, ref_rstd(x + r), rtol=1e-15, atol=0)


# ---------------------------------------------------------------------------------------------
# Rows wider than one block: the two-pass path.


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 columns (and few backward programs), so small rows take the multi-block path
    and backward programs own several rows."""
    monkeypatch.setattr(launch, "MAX_BLOCK_N", 64)
    monkeypatch.setattr(launch, "MAX_BLOCK_N_FP64", 64)
    monkeypatch.setattr(launch, "BWD_PROGRAM_THREADS", 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_block_forward(small_blocks, dtype):
    rows, n = 3, 200  # 4 blocks, the last one partial
    assert not launch.config(n, dtype)[2]
    gen = torch.Generator().manual_seed(200)
    x = rows_of(rows, n, dtype, gen, 232)
    r = rows_of(rows, n, torch.float32, gen)
    w = weight_of(n, gen)
    for rounding in ("fp32_sum", "round_first"):
        for cast in ("deepseek", "hf"):
            y, ro, rstd = torch.empty(rows, n, dtype=dtype), torch.empty_like(r), torch.empty(rows)
            launch.forward(x, r, w, EPS, cast == "hf", rounding == "round_first", y, ro, rstd)
            y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS, cast, rounding, torch.float32)
            assert_bitwise(ro, ro_ref)
            assert_close_y(y, y_ref, cast)
    y_ref, ro_ref = fused_add_rms_norm_ref(x, r.to(dtype), w, EPS)
    xi, ri = x.clone(), r.to(dtype)
    launch.forward(xi, ri, w, EPS, False, False, xi, ri, None)
    assert_bitwise(ri, ro_ref)
    assert_close_y(xi, y_ref)
    y = torch.empty(rows, n, dtype=dtype)
    launch.forward(x, None, w, EPS, False, False, y, None, None)
    assert_close_y(y, rms_norm_ref(x, w, EPS))


def test_multi_block_real_width():
    # Just past the real MAX_BLOCK_N: two blocks of 8192, the second nearly empty.
    n = launch.MAX_BLOCK_N + 40
    assert not launch.config(n, torch.bfloat16)[2]
    gen = torch.Generator().manual_seed(n)
    x = rows_of(2, n, torch.bfloat16, gen)
    r = rows_of(2, n, torch.bfloat16, gen)
    w = weight_of(n, gen)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(2)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS)
    assert_bitwise(ro, ro_ref)
    assert max_ulp(y, y_ref) <= 1
    _check_backward(x, r, w, rstd, None, False, x.float() + r.float())


# ---------------------------------------------------------------------------------------------
# Backward.


def _run_backward(dy, x, r, w, rstd, dro, round_first, write_dr=None):
    """The launcher's backward; by default dresidual is written only for a residual of another
    dtype than x's (as along a chain of fused norms, where dx serves both), else as ``write_dr``
    says."""
    if write_dr is None:
        write_dr = r is not None and r.dtype != x.dtype
    dx = torch.empty(x.shape, dtype=x.dtype)
    dr = torch.empty(r.shape, dtype=r.dtype) if write_dr else None
    dw = torch.empty(w.shape, dtype=w.dtype)
    launch.backward(dy, x, r, w, rstd, dro, round_first, dx, dr, dw)
    return dx, dr, dw


def _check_backward(x, r, w, rstd, dro, round_first, s, gen=None):
    """Gradients against fp64 autograd of the reference formula, and dweight's determinism."""
    gen = gen or torch.Generator().manual_seed(1)
    dy = rows_of(x.shape[0], x.shape[1], x.dtype, gen)
    dx, dr, dw = _run_backward(dy, x, r, w, rstd, dro, round_first)
    ds_ref, dw_ref = rms_norm_backward_ref(dy, s, w, EPS)
    if dro is not None:
        ds_ref = ds_ref + dro.double()
    term = float((dy.double() * w.double() * rstd.double()[:, None]).abs().max())
    assert_grad_close(dx, ds_ref, term)
    if dr is not None:
        assert_grad_close(dr, ds_ref, term)
    assert_grad_close(dw, dw_ref)
    # Again (dweight's determinism), with dresidual written where it was not (and the reverse):
    # the flag changes nothing else, and a dresidual in x's dtype is dx's bits.
    dx2, dr2, dw2 = _run_backward(dy, x, r, w, rstd, dro, round_first, write_dr=r is not None and dr is None)
    assert_bitwise(dw2, dw)
    assert_bitwise(dx2, dx)
    if dr2 is not None:
        assert_bitwise(dr2, dx)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,stride", [(3, 1, None), (3, 111, None), (2, 512, 576), (2, 7168, None)])
def test_rms_norm_backward(dtype, rows, n, stride):
    gen = torch.Generator().manual_seed(n * 13 + rows)
    x = rows_of(rows, n, dtype, gen, stride)
    w = weight_of(n, gen)
    y, rstd = torch.empty(rows, n, dtype=dtype), torch.empty(rows)
    launch.forward(x, None, w, EPS, False, False, y, None, rstd)
    _check_backward(x, None, w, rstd, None, False, x.float(), gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["fp32_sum", "round_first"])
@pytest.mark.parametrize("res_fp32", [False, True])
def test_fused_backward(dtype, rounding, res_fp32):
    rows, n, stride = 3, 512, 576
    gen = torch.Generator().manual_seed(17)
    res_dtype = torch.float32 if res_fp32 else dtype
    x = rows_of(rows, n, dtype, gen, stride)
    r = rows_of(rows, n, res_dtype, gen, stride)
    w = weight_of(n, gen)
    y, ro, rstd = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=res_dtype), torch.empty(rows)
    launch.forward(x, r, w, EPS, False, rounding == "round_first", y, ro, rstd)
    s = x.float() + r.float()
    if rounding == "round_first":
        s = s.to(dtype).float()
    dro = rows_of(rows, n, res_dtype, gen, stride)
    _check_backward(x, r, w, rstd, dro, rounding == "round_first", s, gen)
    _check_backward(x, r, w, rstd, None, rounding == "round_first", s, gen)


@pytest.mark.parametrize("dtype, res_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                              (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_residual_of_another_dtype(dtype, res_dtype):
    # The reference's residual.float() under torch.autocast: a residual of another dtype than x's,
    # the stream (residual_out, and its gradient) in x's dtype, dresidual in the residual's.
    rows, n, stride = 2, 512, 576
    gen = torch.Generator().manual_seed(19)
    x = rows_of(rows, n, dtype, gen, stride)
    r = rows_of(rows, n, res_dtype, gen, stride, scale=4.0)
    w = weight_of(n, gen)
    for rounding in ("fp32_sum", "round_first"):
        y, ro, rstd = torch.empty(rows, n, dtype=dtype), torch.empty(rows, n, dtype=dtype), torch.empty(rows)
        launch.forward(x, r, w, EPS, False, rounding == "round_first", y, ro, rstd)
        y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS, "deepseek", rounding, None)
        assert_bitwise(ro, ro_ref)
        assert_close_y(y, y_ref)
        s = x.float() + r.float()
        if rounding == "round_first":
            s = s.to(dtype).float()
        _check_backward(x, r, w, rstd, rows_of(rows, n, dtype, gen, stride), rounding == "round_first", s, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_block_backward(small_blocks, dtype):
    rows, n = 5, 200  # 4 column blocks; 2 or 3 rows per program
    gen = torch.Generator().manual_seed(99)
    x = rows_of(rows, n, dtype, gen, 256)
    r = rows_of(rows, n, dtype, gen)
    w = weight_of(n, gen)
    assert launch.backward_rows_per_program(rows, n, dtype) > 1
    y, ro, rstd = torch.empty(rows, n, dtype=dtype), torch.empty_like(r), torch.empty(rows)
    launch.forward(x, r, w, EPS, False, True, y, ro, rstd)
    _check_backward(x, r, w, rstd, rows_of(rows, n, dtype, gen), True, ro.float(), gen)
    launch.forward(x, None, w, EPS, False, False, y, None, rstd)
    _check_backward(x, None, w, rstd, None, False, x.float(), gen)


@pytest.mark.parametrize("prefetch", [True, False])
def test_backward_rows_per_program(small_blocks, monkeypatch, prefetch):
    # Several rows per program on the single-block path too (dweight partials over row blocks), the
    # last program's block partial (7 rows, 4 a program), with and without the next-row prefetch.
    monkeypatch.setattr(launch, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(launch, "BWD_PREFETCH_MIN_BLOCK", 1)
    rows, n = 7, 48
    dtype = torch.bfloat16
    assert launch.config(n, dtype)[2] and launch.backward_rows_per_program(rows, n, dtype) > 1
    gen = torch.Generator().manual_seed(7)
    x, r, w = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen), weight_of(n, gen)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(rows)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    _check_backward(x, r, w, rstd, None, False, x.float() + r.float(), gen)


def test_launch_heuristics_and_their_plans(monkeypatch):
    # The backward's warps: one 16-byte vector a thread, up to 16 warps fused and 32 plain (measured
    # on an H200 at [16384, 7168] bf16); wide rows get half the programs. The plans that cache these
    # per shape are keyed on the module's settings too: a changed setting is never served a stale one.
    bf = torch.bfloat16
    assert [launch.backward_config(n, bf, fused)[1] for n in (7168, 1536, 512) for fused in (True, False)] == [
        16, 32, 8, 8, 2, 2]
    assert launch.backward_config(7168, torch.float32, False)[1] == 16  # 16-bit rows only (measured)
    assert launch.backward_rows_per_program(16384, 7168, torch.float32, True) == 16384 // (
        launch.BWD_PROGRAM_THREADS // 512)
    assert launch.backward_rows_per_program(16384, 7168, bf, True) == 16384 // (launch.BWD_PROGRAM_THREADS_WIDE // 512)
    assert launch.backward_rows_per_program(16384, 7168, bf, False) == 16384 // (launch.BWD_PROGRAM_THREADS_WIDE // 1024)
    assert launch.backward_rows_per_program(16384, 1536, bf, True) == 16384 // (launch.BWD_PROGRAM_THREADS // 256)
    x = torch.empty(64, 7168, dtype=bf)
    w, rstd = torch.empty(7168), torch.empty(64)
    fwd = lambda: launch.forward_params(x, x, w, 1e-6, False, False, x, x, rstd)  # noqa: E731
    assert fwd()[2] is fwd()[2] and fwd()[2]["num_warps"] == 8
    plain = lambda: launch.backward_params(x, x, None, w, rstd, None, False, x, None,  # noqa: E731
                                           launch.backward_partials(x, fused=False))[2]
    assert plain()["num_warps"] == 32 and plain()["NUM_STAGES"] == 1  # the row loop is never pipelined
    monkeypatch.setattr(launch, "MAX_WARPS_PLAIN_BWD", 16)
    assert plain()["num_warps"] == 16
    monkeypatch.setattr(launch, "MAX_WARPS", 4)
    assert fwd()[2]["num_warps"] == 4
    with pytest.raises(AssertionError):  # partials sized for the fused backward's programs
        launch.backward_params(x, x, None, w, rstd, None, False, x, None,
                               torch.empty(launch.backward_partials(x, fused=True).shape[0] + 1, 7168))


class _FakeCudaTensor:
    """What ``launch._launch`` reads of a CUDA tensor, on a machine without one."""

    is_cuda = True

    def __init__(self, address, dtype=torch.bfloat16, device=0):
        self.address, self.dtype, self.device = address, dtype, device

    def data_ptr(self):
        return self.address

    def get_device(self):
        return self.device


def test_direct_launch_keys_on_what_triton_specialises(monkeypatch):
    # launch._launch (CUDA only; here with stand-ins for the tensors, Triton's kernel and its
    # compiled kernel): the first launch of a plan goes through Triton and keeps the compiled kernel
    # it returns; a launch that Triton would specialise the same way calls that kernel with the
    # grid as three dimensions and the constexprs appended in parameter order; anything Triton
    # specialises on (a tensor's dtype or 16-byte alignment, an int being 1, a multiple of 16, past
    # int32; the device) gets its own. CPU tensors (the interpreter) always take Triton's launch.
    from triton.compiler import CompiledKernel

    calls = []

    class Compiled(CompiledKernel):
        module = None  # a stand-in: no module loaded (nor unloaded)

        def __init__(self, tag):
            self.tag = tag

        def __getitem__(self, grid):
            return lambda *a: calls.append(("direct", self.tag, grid, a))

    class Kernel:
        arg_names = ["X", "Y", "stride", "n", "eps", "A", "B"]

        def __getitem__(self, grid):
            def jit(*a, **meta):
                calls.append(("triton", grid, a, meta))
                return Compiled(len(calls))
            return jit

    kernel, meta = Kernel(), {"B": 2, "A": 1, "num_warps": 4}
    launches = launch._Launches((5,))
    x, y = _FakeCudaTensor(4096), _FakeCudaTensor(8192)

    def run(*args):
        calls.clear()
        launch._launch(kernel, (5,), args, meta, launches)
        return calls[0]

    assert run(x, y, 32, 7, 1e-6)[0] == "triton"
    assert run(x, y, 32, 7, 1e-6) == ("direct", 1, (5, 1, 1), (x, y, 32, 7, 1e-6, 1, 2))
    assert run(x, y, 32, 7, 0.5)[0] == "direct"  # floats are not specialised
    assert run(_FakeCudaTensor(4096 + 2), y, 32, 7, 1e-6)[0] == "triton"  # off 16-byte alignment
    assert run(_FakeCudaTensor(4096 + 32), y, 32, 7, 1e-6)[0] == "direct"  # aligned elsewhere
    assert run(_FakeCudaTensor(4096, torch.float16), y, 32, 7, 1e-6)[0] == "triton"
    assert run(_FakeCudaTensor(4096, device=1), y, 32, 7, 1e-6)[0] == "triton"
    for stride in (33, 1, 2**31, 48):
        assert run(x, y, stride, 7, 1e-6)[0] == ("triton" if stride != 48 else "direct")
    assert run(x, y, 32, 1, 1e-6)[0] == "triton"
    assert len(launches.compiled) == 8
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
    assert run(x, y, 32, 7, 1e-6)[0] == "triton"
    monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
    # Triton settings its runtime keys kernels on: while one is set, Triton launches (and compiles
    # what it needs); what it compiled then is not kept.
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    assert run(x, y, 32, 7, 1e-6)[0] == run(x, y, 32, 9, 1e-6)[0] == "triton"
    monkeypatch.setattr(triton.knobs.runtime, "debug", False)
    assert run(x, y, 32, 7, 1e-6)[0] == "direct" and run(x, y, 32, 9, 1e-6)[0] == "direct"
    assert len(launches.compiled) == 8
    # Another kernel object (a reload, a replacement) starts the plan's launches over.
    kernel = Kernel()
    assert run(x, y, 32, 7, 1e-6)[0] == "triton" and len(launches.compiled) == 1
    # Anything but a compiled kernel back from Triton (3.9's asynchronous compile: a future) is not kept.
    Kernel.__getitem__ = lambda self, grid: lambda *a, **m: calls.append(("triton", grid, a, m)) or object()
    assert run(x, y, 33, 7, 1e-6)[0] == run(x, y, 33, 7, 1e-6)[0] == "triton"
    cpu = torch.empty(2)
    assert run(cpu, cpu, 32, 7, 1e-6)[0] == run(cpu, cpu, 32, 7, 1e-6)[0] == "triton"
    # The real kernels: every parameter after the runtime arguments is a constexpr of the plans.
    x = torch.empty(2, 64, dtype=torch.bfloat16)
    w, rstd = torch.empty(64), torch.empty(2)
    grid, args, meta = launch.forward_params(x, x, w, 1e-6, False, False, x, x, rstd)
    assert kernels.rms_norm_fwd_kernel.arg_names[len(args):] == [k for k in meta if k not in launch.OPTION_NAMES]
    _, args, meta = launch.backward_params(x, x, x, w, rstd, None, False, x, x, launch.backward_partials(x))
    assert kernels.rms_norm_bwd_kernel.arg_names[len(args):] == [k for k in meta if k not in launch.OPTION_NAMES]


def test_direct_launch_key_agrees_with_tritons_specialisation():
    # launch._specialisation must tell apart every two arguments that Triton's runtime compiles
    # different kernels for (its C++ specialisation, as `kernel[grid]` calls it for the CUDA
    # backend): ints around every boundary it draws (1, multiples of 16, the i32 / i64 / u64
    # ranges) and tensors of several dtypes at every byte offset up to 32.
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))

    def tritons(a):
        return native_specialize_impl(backend, a, False, True, True)

    edges = [0, 2**31, 2**63, 2**64 - 16]
    ints = sorted({e + d for e in edges for d in (-17, -16, -15, -1, 0, 1, 15, 16, 17)} | {-(2**31), -(2**31) - 1,
                                                                                              2**63 - 1, 2**64 - 1})
    ints = [v for v in ints if -(2**63) <= v < 2**64]
    base = torch.empty(64, dtype=torch.uint8)
    tensors = [base[o:o + 16].view(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
               for o in range(0, 32, dtype.itemsize)]
    for group in (ints, tensors):
        seen = {}
        for a in group:
            key = launch._specialisation([a])
            assert seen.setdefault(key, tritons(a)) == tritons(a), (a, key)


# benchmarks/bwd_stages.py: the backward with its row loop software-pipelined, an experiment that
# the library does not ship (its launcher passes NUM_STAGES=1).


def test_pipelined_backward_experiment(small_blocks, monkeypatch):
    # The experiment's launch on the rows of test_backward_rows_per_program (7 rows, 4 a program,
    # prefetched), with 3 stages: the interpreter runs the loop unpipelined (what the GPU's cp.async
    # copies do is checked by test_cuda.py, that they are there by the sm_90 compile), so this holds
    # the launch itself: the same gradients, bit for bit, as the library's backward.
    from conftest import load_benchmark

    bwd_stages = load_benchmark("bwd_stages")
    monkeypatch.setattr(launch, "BWD_PREFETCH_MIN_BLOCK", 1)
    rows, n = 7, 48
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    x, r, w = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen), weight_of(n, gen)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(rows)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    dy, dro = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen)
    meta = bwd_stages.backward_params(dy, x, r, w, rstd, dro, False, torch.empty_like(x), None,
                                      launch.backward_partials(x), 3)[2]
    assert meta["NUM_STAGES"] == 3 and meta["PREFETCH"] and meta["ROWS_PER_PROG"] > 1
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    bwd_stages.backward(dy, x, r, w, rstd, dro, False, dx, None, dw, 3)
    want = _run_backward(dy, x, r, w, rstd, dro, False)
    assert_bitwise(dx, want[0])
    assert_bitwise(dw, want[2])


def test_backward_stages_fit_shared_memory(monkeypatch):
    # Stages asked for are cut until (stages - 1) rows of every input the loop loads fit in
    # BWD_STAGES_SMEM (96 KiB), less a compute-dtype row when the dtypes differ (Triton's layout
    # conversion scratch); the multi-block path is never pipelined. (What Triton really allocates
    # is checked against these by the sm_90 compile test.)
    from conftest import load_benchmark

    bwd_stages = load_benchmark("bwd_stages")
    bf, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    assert bwd_stages.backward_stages(8192, [bf, bf], 4) == 4  # plain bf16 [*, 7168]: 16 KiB a row
    assert bwd_stages.backward_stages(8192, [bf, bf, bf], 4) == 3  # fused bf16
    assert bwd_stages.backward_stages(8192, [f32] * 3, 4) == 2  # fused fp32: 96 KiB a stage
    assert bwd_stages.backward_stages(8192, [f32] * 4, 4) == 1  # fused fp32 with a residual_out gradient
    assert bwd_stages.backward_stages(4096, [bf, bf, f32], 4) == 3  # 32 KiB a stage, 80 KiB left
    assert bwd_stages.backward_stages(8192, [bf, bf, f32], 4) == 2  # 64 KiB a stage, 64 KiB left
    assert bwd_stages.backward_stages(8192, [bf, bf, f32, f32], 4) == 1
    assert bwd_stages.backward_stages(2048, [f64, f64, f32, f32], 4) == 2  # 48 KiB a stage, 80 KiB left
    x = torch.empty(2, 7168)
    meta = bwd_stages.backward_params(x, x, x, torch.empty(7168), torch.empty(2), None, False, x, x,
                                      launch.backward_partials(x), 4)[2]
    assert meta["SINGLE_BLOCK"] and meta["NUM_STAGES"] == 2
    xb, r32 = torch.empty(2, 7168, dtype=bf), torch.empty(2, 7168)
    meta = bwd_stages.backward_params(xb, xb, r32, torch.empty(7168), torch.empty(2), r32, False, xb, r32,
                                      launch.backward_partials(xb), 4)[2]
    assert meta["NUM_STAGES"] == 1
    monkeypatch.setattr(launch, "MAX_BLOCK_N", 1024)
    meta = bwd_stages.backward_params(xb, xb, None, torch.empty(7168), torch.empty(2), None, False, xb, None,
                                      launch.backward_partials(xb, fused=False), 4)[2]
    assert not meta["SINGLE_BLOCK"] and meta["NUM_STAGES"] == 1
    assert bwd_stages.backward_stages(512, [bf, bf], 1) == 1


def test_backward_fp64():
    rows, n = 3, 100
    gen = torch.Generator().manual_seed(8)
    x, r = rows_of(rows, n, torch.float64, gen), rows_of(rows, n, torch.float64, gen)
    w = weight_of(n, gen, torch.float64)
    y, ro, rstd = torch.empty_like(x), torch.empty_like(r), torch.empty(rows, dtype=torch.float64)
    launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
    _check_backward(x, r, w, rstd, rows_of(rows, n, torch.float64, gen), False, x + r, gen)


def test_backward_rows_zero():
    n = 16
    x = torch.empty(0, n, dtype=torch.bfloat16)
    dw = torch.full((n,), float("nan"))
    launch.backward(x, x, None, weight_of(n, torch.Generator()), torch.empty(0), None, False, torch.empty_like(x),
                    None, dw)
    assert bool((dw == 0).all())


def test_public_api_through_the_triton_launchers(monkeypatch):
    """The whole op stack (checks, N-D and strided rows, options, autograd) on the Triton launchers,
    as a CUDA tensor would use it: here the CPU slot of ops.py's launcher table points at them."""
    from dsnorm import ops
    import dsnorm

    monkeypatch.setitem(ops._launchers, "cpu", launch)
    monkeypatch.setattr(ops, "lane", lambda *args: None)  # else the CPU lane takes the no-grad calls
    launches = []
    forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *args: launches.append(1) or forward(*args))
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 3, 576, generator=g).to(torch.bfloat16)
    x = kv[..., :512]
    r = torch.randn(2, 3, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(512, generator=g)
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    assert launches == [1]  # the Triton kernel ran
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert_bitwise(res, res_ref)
    assert_close_y(y, y_ref)
    # Gradients against fp64 autograd of the reference formula (loss = sum: dy = 1).
    def term(s):  # the size of the terms the backward adds: |dy * w * rstd|
        return float((w.double().abs() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + EPS)).max())

    xs, ws = x.float().clone().requires_grad_(), w.clone().requires_grad_()
    dsnorm.rms_norm(xs, ws).sum().backward()
    ds_ref, dw_ref = rms_norm_backward_ref(torch.ones(x.shape), x.float(), w, EPS)
    assert xs.grad.dtype == torch.float32 and ws.grad.dtype == torch.float32
    assert_grad_close(xs.grad, ds_ref, term(x))
    assert_grad_close(ws.grad, dw_ref)
    # A residual of another dtype (fp32 under torch.autocast), through autograd.
    xs, rs, ws = x.clone().requires_grad_(), r.float().clone().requires_grad_(), w.clone().requires_grad_()
    y, res = dsnorm.fused_add_rms_norm(xs, rs, ws)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r.float(), w)
    assert res.dtype == torch.bfloat16
    assert_bitwise(res, res_ref)
    assert_close_y(y, y_ref)
    (y.float().sum() + res.float().sum()).backward()
    assert xs.grad.dtype == torch.bfloat16 and rs.grad.dtype == torch.float32
    s = x.float() + r.float()
    ds_ref, dw_ref = rms_norm_backward_ref(torch.ones(x.shape), s, w, EPS)
    ds_ref = ds_ref + 1.0  # residual_out's gradient
    assert_grad_close(xs.grad, ds_ref, term(s))
    assert_grad_close(rs.grad, ds_ref, term(s))
    assert_grad_close(ws.grad, dw_ref)


def test_chain_through_the_triton_launchers(monkeypatch):
    """A chain of two fused norms through autograd on the Triton launchers: the second norm's
    residual is the first's residual_out, so its backward writes no dresidual (HAS_DR off) and hands
    dx to both; the leaves' gradients are the bits of the same chain with sharing off."""
    from conftest import assert_chain_shares_the_residual_gradient
    from dsnorm import ops

    monkeypatch.setitem(ops._launchers, "cpu", launch)
    g = torch.Generator().manual_seed(5)
    a, b, c, dy, dro = (torch.randn(2, 3, 96, generator=g).to(torch.bfloat16) for _ in range(5))
    assert_chain_shares_the_residual_gradient(monkeypatch, a, b, c, torch.randn(96, generator=g), dy, dro)
