"""The compiled Triton kernels on a CUDA device, through the public API, against ``dsnorm.ref``.

These run only where torch sees a CUDA device (the device check of the GPU issue; CI has none, and
the same kernels run there through Triton's interpreter in ``test_triton_interpret.py``). The
criteria are the interpreter tests': residual bitwise, ``y`` within one ulp (two with
``cast="hf"``; fp32: 4e-6 relative), gradients against fp64 autograd of the reference formula, dweight the same bits run
to run, a row's bits independent of the launch's row count; plus what only a GPU shows:
``torch.compile`` and CUDA graph capture give eager's bits, and a CPU weight with a CUDA input is
refused by name.

Shapes are few and small: every new combination of flags is a Triton compilation.
"""

import pytest
import torch

import dsnorm
from dsnorm import fusions
from dsnorm.fusions import act_quant_ref
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_backward_ref, rms_norm_ref

from conftest import assert_chain_shares_the_residual_gradient, bits_equal, count_lane_calls

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (rows, n, parent row width or None): n=1, odd, the strided 512-of-576 kv slice, DeepSeek's 1536
# and 7168, and 9000 (wider than one 8192-column block: the two-pass path).
SHAPES = [(3, 1, None), (3, 111, None), (4, 512, 576), (4, 1536, None), (4, 7168, None), (2, 9000, None)]


def _ordered(t):
    bits = {torch.float32: torch.int32}.get(t.dtype, torch.int16)
    i = t.contiguous().view(bits).to(torch.int64)
    sign = 1 << (torch.iinfo(bits).bits - 1)
    return torch.where(i < 0, -(i + sign), i)


def max_ulp(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    assert torch.equal(a.isnan(), b.isnan()), "NaN positions differ"
    keep = ~a.isnan()
    if not bool(keep.any()):
        return 0
    return int((_ordered(a[keep]) - _ordered(b[keep])).abs().max())


def assert_y_close(y, ref, cast="deepseek"):
    """bf16/fp16 within 1 ulp (2 for cast="hf", which rounds x̂ before the weight multiply: a 1-ulp
    x̂ from the GPU's sum order becomes up to 2 ulps of y); fp32 within 4e-6 relative."""
    y, ref = y.cpu(), ref.cpu()
    if y.dtype == torch.float32:
        err = (y - ref).abs()
        assert bool((err <= 4e-6 * ref.abs()).all()), f"max rel err {float((err / ref.abs()).max())}"
    else:
        assert max_ulp(y, ref) <= (2 if cast == "hf" else 1)


def assert_bitwise(a, b):
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a.masked_fill(nan, 0).contiguous().view(torch.uint8),
                       b.masked_fill(nan, 0).contiguous().view(torch.uint8))


def rows_of(rows, n, dtype, gen, stride=None, scale=1.0):
    width = n if stride is None else stride
    full = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * scale).to(dtype).cuda()
    return full[:, :n]


def weight_of(n, gen):
    return (1.0 + 0.25 * torch.randn(n, generator=gen, dtype=torch.float64)).float().cuda()


# ---------------------------------------------------------------------------------------------
# Forward through the public functions.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,stride", SHAPES)
def test_forward(dtype, rows, n, stride):
    gen = torch.Generator().manual_seed(n + rows)
    x = rows_of(rows, n, dtype, gen, stride)
    r = rows_of(rows, n, dtype, gen, stride, scale=4.0)
    w = weight_of(n, gen)
    with torch.no_grad():
        y = dsnorm.rms_norm(x, w, EPS)
        assert y.device == x.device and y.dtype == dtype
        assert_y_close(y, rms_norm_ref(x.cpu(), w.cpu(), EPS))
        y, ro = dsnorm.fused_add_rms_norm(x, r, w, EPS)
        y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS)
        assert_bitwise(ro, ro_ref)
        assert_y_close(y, y_ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_another_device_than_the_current_one():
    # Triton launches on the current device: dsnorm makes the tensors' device current around each
    # launch (device_map="auto" places layers on cuda:1 while cuda:0 stays current).
    gen = torch.Generator().manual_seed(2)
    torch.cuda.set_device(0)
    x, r = rows_of(4, 1536, torch.bfloat16, gen).to("cuda:1"), rows_of(4, 1536, torch.bfloat16, gen).to("cuda:1")
    w = weight_of(1536, gen).to("cuda:1")
    y, ro = dsnorm.fused_add_rms_norm(x, r, w, EPS)
    y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS)
    assert y.device == x.device and torch.cuda.current_device() == 0
    assert_bitwise(ro, ro_ref)
    assert_y_close(y, y_ref)
    xg, wg = x.clone().float().requires_grad_(), w.clone().requires_grad_()
    dsnorm.rms_norm(xg, wg, EPS).sum().backward()
    xr, wr = x.cpu().float().requires_grad_(), w.cpu().requires_grad_()
    dsnorm.rms_norm(xr, wr, EPS).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wg.grad.cpu(), wr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [111, 7168, 9000])
def test_forward_options(n):
    gen = torch.Generator().manual_seed(n)
    dtype = torch.bfloat16
    x = rows_of(3, n, dtype, gen)
    w = weight_of(n, gen)
    with torch.no_grad():
        assert_y_close(dsnorm.rms_norm(x, w, EPS, cast="hf"), rms_norm_ref(x.cpu(), w.cpu(), EPS, "hf"), "hf")
        for res_dtype in (None, torch.float32):
            r = rows_of(3, n, res_dtype or dtype, gen, scale=4.0)
            for rounding in ("fp32_sum",) if res_dtype else ("fp32_sum", "round_first"):
                for cast in ("deepseek", "hf"):
                    y, ro = dsnorm.fused_add_rms_norm(x, r, w, EPS, cast=cast, residual_rounding=rounding,
                                                      residual_dtype=res_dtype)
                    y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS, cast, rounding,
                                                           res_dtype)
                    assert_bitwise(ro, ro_ref)
                    assert_y_close(y, y_ref, cast)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_strided(dtype):
    rows, n, stride = 5, 512, 576
    gen = torch.Generator().manual_seed(7)
    xp, rp = rows_of(rows, stride, dtype, gen), rows_of(rows, stride, dtype, gen, scale=4.0)
    x_before, r_before = xp.clone(), rp.clone()
    x, r = xp[:, :n], rp[:, :n]
    y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), torch.ones(n), EPS)
    w = torch.ones(n, device="cuda")
    with torch.no_grad():
        out = dsnorm.fused_add_rms_norm_(x, r, w, EPS)
    assert out[0].data_ptr() == x.data_ptr() and out[1].data_ptr() == r.data_ptr()
    assert_bitwise(r, ro_ref)
    assert_y_close(x, y_ref)
    assert torch.equal(xp[:, n:], x_before[:, n:]) and torch.equal(rp[:, n:], r_before[:, n:])


def test_extremes():
    # Overflowing sums (an inf residual), a NaN row, an all-zero row.
    n, dtype = 64, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    x, r = rows_of(3, n, dtype, gen), rows_of(3, n, dtype, gen)
    big = torch.finfo(dtype).max
    x[0], r[0] = big, big
    x[1, 3] = float("nan")
    x[2], r[2] = 0.0, 0.0
    w = weight_of(n, gen)
    with torch.no_grad():
        y, ro = dsnorm.fused_add_rms_norm(x, r, w, EPS)
    y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS)
    assert_bitwise(ro, ro_ref)
    assert max_ulp(y, y_ref) <= 1
    assert bool(ro[0].isinf().all())
    assert bool(y[1].isnan().all()) and bool((y[2] == 0).all())


def test_row_loop_past_the_program_cap_is_batch_invariant():
    # Past launch.FWD_MAX_PROGRAMS rows a program loops over several rows (ROWS_PER_PROG > 1): only
    # the interpreter had run that loop. Each row's bits must be those of a one-row launch.
    from dsnorm.triton import launch

    n, rows = 512, launch.FWD_MAX_PROGRAMS + 1
    gen = torch.Generator().manual_seed(9)
    x, r = rows_of(rows, n, torch.bfloat16, gen), rows_of(rows, n, torch.bfloat16, gen)
    w = weight_of(n, gen)
    with torch.no_grad():
        y, ro = dsnorm.fused_add_rms_norm(x, r, w, EPS)
        for i in (0, 1, rows // 2, rows - 2, rows - 1):
            yi, roi = dsnorm.fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w, EPS)
            assert_bitwise(y[i:i + 1], yi)
            assert_bitwise(ro[i:i + 1], roi)
    y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS)
    assert_bitwise(ro, ro_ref)
    assert max_ulp(y, y_ref) <= 1


def test_subnormal_squares_with_an_eps_below_the_normals():
    # With |x| ~ 1e-22 the squares are fp32 subnormals, and with eps = 1e-45 (accepted) their own
    # roundings make the mean: the fma Triton contracts by default into the sum of squares (one
    # square of a pair unrounded) moved y by up to 9 ulps in an emulation of the sm_90 code. The
    # forward launches turn that off (launch.FWD_OPTIONS): every square is rounded as on the CPU.
    n, rows = 64, 4000
    gen = torch.Generator().manual_seed(1)
    k = torch.empty(rows, n, dtype=torch.float64).uniform_(0.5, 1.5, generator=gen) * 16
    x = (k.sqrt() * 2.0**-74.5 * torch.randn(rows, n, generator=gen, dtype=torch.float64).sign()).bfloat16()
    w = torch.ones(n)
    with torch.no_grad():
        y = dsnorm.rms_norm(x.cuda(), w.cuda(), 1e-45)
    assert max_ulp(y, rms_norm_ref(x, w, 1e-45)) <= 1


def test_empty_input():
    w = torch.ones(7168, device="cuda")
    x = torch.empty(0, 1, 7168, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert dsnorm.rms_norm(x, w).shape == x.shape
        y, ro = dsnorm.fused_add_rms_norm(x, x.clone(), w)
    assert y.shape == ro.shape == x.shape


def test_batch_invariant():
    # Decode (1 row) and prefill (4096 rows) launches give a row the same bits.
    n = 7168
    gen = torch.Generator().manual_seed(11)
    x, r = rows_of(4096, n, torch.bfloat16, gen), rows_of(4096, n, torch.bfloat16, gen)
    w = weight_of(n, gen)
    with torch.no_grad():
        y, ro = dsnorm.fused_add_rms_norm(x, r, w)
        for i in (0, 1234, 4095):
            y1, ro1 = dsnorm.fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w)
            assert_bitwise(y1, y[i:i + 1])
            assert_bitwise(ro1, ro[i:i + 1])


def test_cpu_weight_refused_by_name():
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError, TypeError), match="weight"):
        dsnorm.rms_norm(x, torch.ones(64))


# ---------------------------------------------------------------------------------------------
# Training.


def _grads(device, x, r, w, dy, dres):
    xg = x.detach().to(device).requires_grad_(True)
    wg = w.detach().to(device).requires_grad_(True)
    if r is None:
        y = dsnorm.rms_norm(xg, wg, EPS)
        y.backward(dy.to(device))
        return xg.grad, None, wg.grad
    rg = r.detach().to(device).requires_grad_(True)
    y, ro = dsnorm.fused_add_rms_norm(xg, rg, wg, EPS)
    torch.autograd.backward((y, ro), (dy.to(device), dres.to(device)))
    return xg.grad, rg.grad, wg.grad


def _assert_grad_close(got, ref64, scale):
    """Elementwise: one rounding of got's dtype, plus fp32 arithmetic error relative to ``scale``
    (the size of the terms that were added; they can cancel to a much smaller gradient)."""
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20}[got.dtype]
    err = (got.double().cpu() - ref64).abs()
    bound = half_ulp * ref64.abs() + 1e-6 * scale
    assert bool((err <= bound).all()), f"max err {float(err.max())}, scale {scale}"


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rows,n,stride", [(3, 111, None), (4, 512, 576), (4, 7168, None), (2, 9000, None)])
def test_backward(fused, rows, n, stride):
    # Against fp64 autograd of the reference formula (the CPU kernels' own test reference).
    gen = torch.Generator().manual_seed(n * 3 + fused)
    dtype = torch.bfloat16
    x = rows_of(rows, n, dtype, gen, stride)
    r = rows_of(rows, n, dtype, gen, stride, scale=4.0) if fused else None
    w = weight_of(n, gen)
    dy, dres = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen)
    dx, dr, dw = _grads("cuda", x, r, w, dy, dres)
    s = x.cpu().float() + (0 if r is None else r.cpu().float())
    ds64, dw64 = rms_norm_backward_ref(dy.cpu(), s, w.cpu(), EPS)
    if fused:
        ds64 = ds64 + dres.cpu().double()
    rstd = torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + EPS)
    term = float((dy.cpu().double() * w.cpu().double() * rstd).abs().max())
    scale = max(float(ds64.abs().max()), term)
    _assert_grad_close(dx, ds64, scale)
    if fused:
        _assert_grad_close(dr, ds64, scale)
    assert dw.dtype == torch.float32
    _assert_grad_close(dw, dw64, float(dw64.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_prefetch_rows(dtype, monkeypatch):
    # 2048 rows of 7168: 4 rows a backward program, so the next-row prefetch is used (and masked at
    # each program's end); the results with it equal those without it bit for bit, and the
    # reference's within the tolerance, with round-first and a residual_out gradient too.
    from dsnorm.triton import launch

    rows, n = 2048, 7168
    assert launch.backward_rows_per_program(rows, n, dtype) > 1
    gen = torch.Generator().manual_seed(29)
    x, r = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen, scale=4.0)
    w = weight_of(n, gen)
    dy, dres = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen)
    for rounding in ("fp32_sum", "round_first"):
        grads = []
        for prefetch in (False, True):
            monkeypatch.setattr(launch, "BWD_PREFETCH", prefetch)
            xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
            y, s = dsnorm.fused_add_rms_norm(xg, rg, wg, residual_rounding=rounding)
            torch.autograd.backward((y, s), (dy, dres))
            grads.append((xg.grad, rg.grad, wg.grad))
        for other in grads[1:]:
            for a, b in zip(grads[0], other):
                assert_bitwise(a, b)
        k = 16  # rows checked against the fp64 reference (its autograd is slow on the CPU)
        s_ref = x[:k].cpu().float() + r[:k].cpu().float()
        if rounding == "round_first":
            s_ref = s_ref.to(dtype).float()
        ds64, _ = rms_norm_backward_ref(dy[:k].cpu(), s_ref, w.cpu(), EPS)
        ds64 = ds64 + dres[:k].cpu().double()
        _assert_grad_close(grads[0][0][:k], ds64, float(ds64.abs().max()))


def test_backward_of_an_fp32_residual_stream():
    # bf16 x with an fp32 residual stream: the one fused case whose dresidual is written apart from
    # dx (HAS_DR): fp32, unrounded; dx is its bf16 rounding, both of the fp64 reference's ds.
    gen = torch.Generator().manual_seed(37)
    for rows, n in ((3, 111), (4, 7168), (2, 9000)):
        x = rows_of(rows, n, torch.bfloat16, gen)
        r = rows_of(rows, n, torch.bfloat16, gen, scale=4.0).float()
        w = weight_of(n, gen)
        dy, dres = rows_of(rows, n, torch.bfloat16, gen), rows_of(rows, n, torch.float32, gen)
        xg = x.cuda().requires_grad_()
        rg = r.cuda().requires_grad_()
        y, ro = dsnorm.fused_add_rms_norm(xg, rg, w.cuda(), EPS, residual_dtype=torch.float32)
        dx, dr = torch.autograd.grad((y, ro), (xg, rg), (dy.cuda(), dres.cuda()))
        assert dx.dtype == torch.bfloat16 and dr.dtype == torch.float32
        assert_bitwise(dx, dr.to(torch.bfloat16))
        s = x.cpu().float() + r.cpu()  # the reference on the CPU, as _assert_grad_close compares there
        ds64, _ = rms_norm_backward_ref(dy.cpu(), s, w.cpu(), EPS)
        ds64 = ds64 + dres.cpu().double()
        _assert_grad_close(dr, ds64, float(ds64.abs().max()))


@pytest.mark.parametrize("dtype, res_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                                              (torch.float32, torch.bfloat16)])
def test_residual_of_another_dtype(dtype, res_dtype):
    # The reference's residual.float() under torch.autocast: the stream comes back in x's dtype,
    # bitwise; dresidual in the residual's dtype, of the fp64 reference's ds.
    gen = torch.Generator().manual_seed(38)
    for rows, n, stride in ((3, 111, None), (4, 512, 576), (4, 7168, None)):
        x = rows_of(rows, n, dtype, gen, stride)
        r = rows_of(rows, n, res_dtype, gen, stride, scale=4.0)
        w = weight_of(n, gen)
        dy, dres = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen)
        xg, rg = x.cuda().requires_grad_(), r.cuda().requires_grad_()
        y, ro = dsnorm.fused_add_rms_norm(xg, rg, w.cuda(), EPS)
        y_ref, ro_ref = fused_add_rms_norm_ref(x, r, w, EPS)
        assert ro.dtype == dtype
        assert_bitwise(ro.cpu(), ro_ref)
        assert_y_close(y.cpu(), y_ref)
        dx, dr = torch.autograd.grad((y, ro), (xg, rg), (dy.cuda(), dres.cuda()))
        assert dx.dtype == dtype and dr.dtype == res_dtype
        ds64, _ = rms_norm_backward_ref(dy, x.float() + r.float(), w, EPS)
        ds64 = ds64 + dres.double()
        _assert_grad_close(dr, ds64, float(ds64.abs().max()))
        _assert_grad_close(dx, ds64, float(ds64.abs().max()))


def test_chain_of_fused_norms_shares_the_residual_gradient(monkeypatch):
    # Along a chain (the residual is the previous fused norm's residual_out) the backward kernel
    # writes no dresidual (HAS_DR off) and dx serves both: the leaves' gradients are the bits of
    # the same chain with sharing off.
    gen = torch.Generator().manual_seed(41)
    for rows, n in ((3, 111), (64, 7168), (2, 9000)):
        a, b, c, dy, dro = (rows_of(rows, n, torch.bfloat16, gen) for _ in range(5))
        assert_chain_shares_the_residual_gradient(monkeypatch, a, b, c, weight_of(n, gen), dy, dro, EPS)


@pytest.mark.parametrize("rows,n,stride", [(64, 7168, None), (8, 512, 576)])
def test_training_lane_on_cuda(monkeypatch, rows, n, stride):
    # The training forward's lane (CUDA tensors on one device; kv_norm's strided rows read in place)
    # against the general path, which the lane skips: outputs and gradients of one fused and one
    # plain call, the same bits.
    from dsnorm import ops

    gen = torch.Generator().manual_seed(43)
    x, r = (rows_of(rows, n, torch.bfloat16, gen, stride) for _ in range(2))
    g, w = rows_of(rows, n, torch.bfloat16, gen), weight_of(n, gen)
    calls = count_lane_calls(monkeypatch)

    def train():
        xs, rs, ws = (t.detach().requires_grad_() for t in (x, r, w))
        y, ro = dsnorm.fused_add_rms_norm(xs, rs, ws, EPS)
        z = dsnorm.rms_norm(xs, ws, EPS)
        torch.autograd.backward((y, ro, z), (g, g.flip(-1), g))
        return [t.detach().clone() for t in (y, ro, z, xs.grad, rs.grad, ws.grad)]

    train()
    calls[:] = [0, 0]
    got = train()
    assert calls == [1, 1]
    monkeypatch.setattr(ops, "train_lane_plain", lambda *a: False)
    monkeypatch.setattr(ops, "train_lane_fused", lambda *a: False)
    want = train()
    assert calls == [1, 1]
    for a, b in zip(got, want):
        assert bits_equal(a, b)


def test_direct_launch_only_reuses_a_matching_compiled_kernel(monkeypatch):
    # After a plan's first launch the launcher calls Triton's compiled kernel itself. A launch that
    # Triton would compile differently must not get that kernel: rows off 16-byte alignment (a bf16
    # slice starting one element in), a row stride not a multiple of 16. Each takes its own compiled
    # kernel, with Triton's own launch's bits; a wrong reuse would read misaligned vectors (a CUDA
    # fault) or the wrong rows. (One row is a plan of its own, rows being in the plan's key; the
    # CPU tests hold the key's other distinctions, an int equal to 1 among them.)
    from dsnorm.triton import launch

    gen = torch.Generator().manual_seed(61)
    base = rows_of(4, 1568, torch.bfloat16, gen)  # a row stride that is a multiple of 16
    res = rows_of(4, 1536, torch.bfloat16, gen)
    w = weight_of(1536, gen)
    variants = {"aligned": base[:, :1536], "misaligned": base[:, 1:1537], "stride 1537": base.reshape(-1)[:4 * 1537]
                .view(4, 1537)[:, :1536], "one row": base[:1, :1536]}
    assert base[:, 1:1537].data_ptr() % 16 != 0

    def forward(x):
        r = res[:x.shape[0]]
        y, ro, rstd = torch.empty_like(r), torch.empty_like(r), torch.empty(x.shape[0], device="cuda")
        launch.forward(x, r, w, EPS, False, False, y, ro, rstd)
        return y, ro, rstd

    launches = launch._forward_plan(4, 1536, torch.bfloat16, True, True, False, False, True)[2]
    launches.compiled.clear()
    for name, x in variants.items():
        first, direct = forward(x), forward(x)
        monkeypatch.setattr(launch, "DIRECT_LAUNCH", False)
        triton_own = forward(x)
        monkeypatch.setattr(launch, "DIRECT_LAUNCH", True)
        for a, b, c in zip(first, direct, triton_own):
            assert_bitwise(a, b)
            assert_bitwise(a, c)
        y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), res[:x.shape[0]].cpu(), w.cpu(), EPS)
        assert_bitwise(first[1], ro_ref)
        assert_y_close(first[0], y_ref)
    # Four-row launches share a plan: aligned, misaligned and the odd stride each compiled their own.
    assert len(launches.compiled) == 3 and launches.constexprs[0] == 1  # ROWS_PER_PROG first


# benchmarks/bwd_stages.py: the backward with its row loop software-pipelined, an experiment that
# the library does not ship (its launcher passes NUM_STAGES=1).


def _pipelined_matches_the_library(x, r, w, dy, dro, round_first, stages):
    """The experiment's backward of these rows (``stages`` asked for) against the library's: the same
    bits of dx, dweight and, for a residual of another dtype, dresidual. Returns the experiment's
    module."""
    from conftest import load_benchmark
    from dsnorm.triton import launch

    bwd_stages = load_benchmark("bwd_stages")
    rstd = torch.empty(x.shape[0], device=x.device)
    launch.forward(x, r, w, EPS, False, round_first, torch.empty_like(x), None if r is None else torch.empty_like(r),
                   rstd)
    grads = []
    for backward in (launch.backward, lambda *args: bwd_stages.backward(*args, stages)):
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        dr = torch.empty_like(r) if r is not None and r.dtype != x.dtype else None
        backward(dy, x, r, w, rstd, dro, round_first, dx, dr, dw)
        grads.append([g for g in (dx, dr, dw) if g is not None])
    for a, b in zip(*grads):
        assert_bitwise(a, b)
    return bwd_stages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_pipelined_rows(dtype, monkeypatch):
    # The rows of test_backward_prefetch_rows (4 a backward program) with the loop pipelined over 3
    # stages, prefetched and not, round-first and not, with a residual_out gradient: the library's bits.
    from dsnorm.triton import launch

    rows, n = 2048, 7168
    gen = torch.Generator().manual_seed(29)
    x, r = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen, scale=4.0)
    w = weight_of(n, gen)
    dy, dres = rows_of(rows, n, dtype, gen), rows_of(rows, n, dtype, gen)
    assert launch.backward_rows_per_program(rows, n, dtype) > 1
    for round_first in (False, True):
        for prefetch in (False, True):
            monkeypatch.setattr(launch, "BWD_PREFETCH", prefetch)
            _pipelined_matches_the_library(x, r, w, dy, dres, round_first, 3)


def test_backward_pipelined_plain_and_fp32():
    # The pipelined backward on the plain norm it is meant for, [2048, 7168] bf16, and on fp32 fused
    # rows, where 4 stages asked for are cut to what BWD_STAGES_SMEM holds (2) and must still launch:
    # the same bits as the library's unpipelined kernel.
    gen = torch.Generator().manual_seed(31)
    n = 7168
    for dtype, fused in ((torch.bfloat16, False), (torch.float32, True)):
        x, r = rows_of(2048, n, dtype, gen), rows_of(2048, n, dtype, gen, scale=4.0)
        w, dy = weight_of(n, gen), rows_of(2048, n, dtype, gen)
        bwd_stages = _pipelined_matches_the_library(x, r if fused else None, w, dy, None, False, 4)
    assert bwd_stages.backward_stages(8192, [torch.float32] * 3, 4) == 2


def test_dweight_deterministic():
    rows, n = 8192, 7168
    gen = torch.Generator().manual_seed(3)
    x, r = rows_of(rows, n, torch.bfloat16, gen), rows_of(rows, n, torch.bfloat16, gen)
    w = weight_of(n, gen)
    dy, dres = rows_of(rows, n, torch.bfloat16, gen), rows_of(rows, n, torch.bfloat16, gen)
    first = _grads("cuda", x, r, w, dy, dres)
    for _ in range(2):
        again = _grads("cuda", x, r, w, dy, dres)
        for a, b in zip(first, again):
            assert_bitwise(a, b)


# ---------------------------------------------------------------------------------------------
# What a serving stack does with it: torch.compile, CUDA graphs.


def test_module_under_torch_compile():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    norm = dsnorm.RMSNorm(7168).cuda()
    with torch.no_grad():
        norm.weight.copy_(weight_of(7168, gen))
    x, r = rows_of(8, 7168, torch.bfloat16, gen).view(8, 1, 7168), rows_of(8, 7168, torch.bfloat16, gen).view(8, 1, 7168)

    def block(x, r):
        y, s = norm(x, r)
        return y * 2, s

    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        eager = block(x, r)
        got = compiled(x, r)
    for a, b in zip(got, eager):
        assert_bitwise(a, b)


def test_cuda_graph_capture():
    gen = torch.Generator().manual_seed(17)
    norm = dsnorm.RMSNorm(7168).cuda()
    with torch.no_grad():
        norm.weight.copy_(weight_of(7168, gen))
    x, r = rows_of(1, 7168, torch.bfloat16, gen).view(1, 1, 7168), rows_of(1, 7168, torch.bfloat16, gen).view(1, 1, 7168)
    with torch.no_grad():
        want = norm(x, r)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            norm(x, r)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = norm(x, r)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert_bitwise(a, b)


def test_patch_replaces_the_norms_of_a_cuda_model():
    """patch probes a GPU model's norms as CPU copies (bitwise is the CPU's guarantee; probed on the
    GPU in fp32, every norm would differ in its sum order and be left in place): the reference class
    and a Hugging Face norm on CUDA are replaced, stay on the GPU, and agree with the modules they
    replaced to the GPU's tolerance (one ulp, two for cast="hf"; fp32 4e-6 relative)."""
    transformers = pytest.importorskip("transformers")
    from torch import nn

    from dsnorm.ref import RMSNormRef

    hf_norm = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm
    gen = torch.Generator().manual_seed(37)
    holder = nn.ModuleDict({"ref": RMSNormRef(1536), "hf": hf_norm(512, eps=1e-6).to(torch.bfloat16)}).cuda()
    with torch.no_grad():
        holder["ref"].weight.copy_(weight_of(1536, gen))
        holder["hf"].weight.copy_(weight_of(512, gen).to(torch.bfloat16))
    old = dict(holder.items())
    report = dsnorm.patch(holder)
    assert sorted(e.name for e in report.replaced) == ["hf", "ref"] and not report.left, str(report)
    assert all("CPU copies" in e.reason for e in report.replaced)
    for key, n, cast in (("ref", 1536, "deepseek"), ("hf", 512, "hf")):
        new = holder[key]
        assert isinstance(new, dsnorm.RMSNorm) and new.cast == cast and new.weight.is_cuda
        for dtype in (torch.bfloat16, torch.float32):
            x = rows_of(4, n, dtype, gen)
            with torch.no_grad():
                assert_y_close(new(x), old[key](x), cast)


def test_final_norm_capture_needs_lengths_none():
    """final_norm checks lengths' values on the host: under a capture that is refused by name (a
    clear error, not CUDA's), and the last-position form (lengths=None) captures and replays."""
    gen = torch.Generator().manual_seed(31)
    h = rows_of(2 * 3, 1536, torch.bfloat16, gen).view(2, 3, 1536)
    res = rows_of(2 * 3, 1536, torch.bfloat16, gen).view(2, 3, 1536)
    w = weight_of(1536, gen)
    lengths = torch.tensor([3, 2], device="cuda")
    with torch.no_grad():
        want = fusions.final_norm(h, res, w)
        fusions.final_norm(h, res, w, lengths=lengths)  # compiled before the capture
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="lengths: final_norm checks"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                fusions.final_norm(h, res, w, lengths=lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fusions.final_norm(h, res, w)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert_bitwise(a, b)


# ---------------------------------------------------------------------------------------------
# The DeepSeek fusions' Triton kernels.


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_fusions(scale_fmt):
    gen = torch.Generator().manual_seed(19)
    n = 7168
    x, r = rows_of(4, n, torch.bfloat16, gen), rows_of(4, n, torch.bfloat16, gen, scale=4.0)
    w = weight_of(n, gen)
    with torch.no_grad():
        q, s, y = fusions.rms_norm_fp8(x, w, scale_fmt=scale_fmt, return_normed=True)
        assert_y_close(y, rms_norm_ref(x.cpu(), w.cpu(), EPS))
        q_ref, s_ref = act_quant_ref(y.cpu(), 128, scale_fmt)  # exact given the kernel's own y
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)
        q, s, ro, y = fusions.fused_add_rms_norm_fp8(x, r, w, scale_fmt=scale_fmt, return_normed=True)
        y_ref, ro_ref = fused_add_rms_norm_ref(x.cpu(), r.cpu(), w.cpu(), EPS)
        assert_bitwise(ro, ro_ref)
        assert_y_close(y, y_ref)
        q_ref, s_ref = act_quant_ref(y.cpu(), 128, scale_fmt)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s.cpu(), s_ref)


def test_final_norm_and_mla():
    gen = torch.Generator().manual_seed(23)
    h = rows_of(2 * 5, 7168, torch.bfloat16, gen).view(2, 5, 7168)
    res = rows_of(2 * 5, 7168, torch.bfloat16, gen, scale=4.0).view(2, 5, 7168)
    w = weight_of(7168, gen)
    lengths = torch.tensor([5, 2], device="cuda")
    with torch.no_grad():
        y, ro = fusions.final_norm(h, res, w, lengths=lengths)
    y_full, ro_full = fused_add_rms_norm_ref(h.cpu(), res.cpu(), w.cpu(), EPS)
    for b, last in enumerate((4, 1)):
        assert_bitwise(ro[b], ro_full[b, last])
        assert_y_close(y[b], y_full[b, last])
    q_latent = rows_of(3, 1536, torch.bfloat16, gen).view(3, 1, 1536)
    kv_a = rows_of(3, 576, torch.bfloat16, gen).view(3, 1, 576)
    qw, kvw = weight_of(1536, gen), weight_of(512, gen)
    kv_before = kv_a.clone()
    with torch.no_grad():
        qn, kvn = fusions.mla_latent_norms(q_latent, kv_a, qw, kvw)
    assert_y_close(qn, rms_norm_ref(q_latent.cpu(), qw.cpu(), EPS))
    assert_y_close(kvn, rms_norm_ref(kv_a.cpu()[..., :512], kvw.cpu(), EPS))
    assert torch.equal(kv_a, kv_before)


def test_fusions_fp64_keep_the_callers_eps():
    """fp64 rows are normalised with eps as a double: at activations of 1e-3 an eps rounded to fp32
    (1e-6 + 2.3e-14, what a kernel would see with its "fp64" annotation ignored) moves y by ~4e-10
    relative, far outside fp64's 1e-14."""
    gen = torch.Generator().manual_seed(29)
    h = rows_of(2 * 3, 1536, torch.float64, gen, scale=1e-3).view(2, 3, 1536)
    res = rows_of(2 * 3, 1536, torch.float64, gen, scale=1e-3).view(2, 3, 1536)
    w = weight_of(1536, gen).double()
    with torch.no_grad():
        y, ro = fusions.final_norm(h, res, w, lengths=torch.tensor([3, 2], device="cuda"))
    y_full, _ = fused_add_rms_norm_ref(h.cpu(), res.cpu(), w.cpu(), EPS)
    torch.testing.assert_close(y.cpu(), torch.stack([y_full[0, 2], y_full[1, 1]]), rtol=1e-14, atol=0)
    q_latent = rows_of(2, 1536, torch.float64, gen, scale=1e-3)
    kv_a = rows_of(2, 576, torch.float64, gen, scale=1e-3)
    qw, kvw = weight_of(1536, gen).double(), weight_of(512, gen).double()
    with torch.no_grad():
        qn, kvn = fusions.mla_latent_norms(q_latent, kv_a, qw, kvw)
    torch.testing.assert_close(qn.cpu(), rms_norm_ref(q_latent.cpu(), qw.cpu(), EPS), rtol=1e-14, atol=0)
    torch.testing.assert_close(kvn.cpu(), rms_norm_ref(kv_a.cpu()[:, :512], kvw.cpu(), EPS), rtol=1e-14, atol=0)
