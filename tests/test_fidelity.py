"""Forward fidelity of the CPU kernels against the in-library reference (dsnorm.ref).

Criteria (core issue): the returned residual is bitwise equal everywhere; y is bitwise equal where
torch's CPU reduction order is the one dsnorm replays (x86, widths <= 16384), else within 1 ulp
(bf16/fp16) or 4e-6 relative (fp32).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsnorm
from dsnorm.ref import RMSNormRef, fused_add_rms_norm_ref, rms_norm_ref

from conftest import assert_y_close, bits_equal, max_ulp

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WIDTHS = [1, 7, 8, 111, 512, 769, 1536, 5125, 7168, 16384]


def _data(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _weight(n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_plain_and_fused_match_reference(dtype, width):
    rows = 3 if width > 2048 else 17
    x, r, w = _data((rows, width), dtype, 0), _data((rows, width), dtype, 1), _weight(width)
    assert_y_close(dsnorm.rms_norm(x, w), rms_norm_ref(x, w), width)
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(res, res_ref)
    assert_y_close(y, y_ref, width)


@pytest.mark.parametrize("shape", [(1, 1, 7168), (64, 1, 7168), (1, 4096, 7168), (4096, 1536), (2, 3, 5, 512)])
def test_deepseek_shapes_bitwise(shape):
    x, r, w = _data(shape, torch.bfloat16, 2), _data(shape, torch.bfloat16, 3), _weight(shape[-1])
    ref = RMSNormRef(shape[-1])
    ref.weight.data.copy_(w)
    mod = dsnorm.RMSNorm(shape[-1])
    mod.weight.data.copy_(w)
    with torch.no_grad():
        assert_y_close(mod(x), ref(x), shape[-1])
        (y, res), (y_ref, res_ref) = mod(x, r), ref(x, r)
    assert y.shape == shape and res.shape == shape
    assert bits_equal(res, res_ref)
    assert_y_close(y, y_ref, shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_read_in_place(dtype):
    # kv_norm reads the first 512 of wkv_a's 576 columns: a strided view, no copy.
    kv = _data((8, 1, 576), dtype, 4)
    x = kv[..., :512]
    assert not x.is_contiguous()
    w = _weight(512)
    assert_y_close(dsnorm.rms_norm(x, w), rms_norm_ref(x, w), 512)
    r = _data((16, 576), dtype, 5)[::2, 64:]  # strided rows and an offset, in the residual too
    x2 = _data((8, 512), dtype, 6)
    y, res = dsnorm.fused_add_rms_norm(x2, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x2, r, w)
    assert bits_equal(res, res_ref) and y.is_contiguous()
    assert_y_close(y, y_ref, 512)


def test_non_unit_inner_stride_and_uncollapsible_rows():
    base = _data((6, 4, 256), torch.bfloat16, 7)
    w = _weight(128)
    for x in (base[:, :, ::2], base[:, ::2, :128].transpose(0, 1)):
        assert_y_close(dsnorm.rms_norm(x, w), rms_norm_ref(x, w), 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_without_unit_stride_take_the_bits_of_a_contiguous_copy(dtype):
    # x.t(): the last dimension is not unit-stride. dsnorm reads such a tensor through a contiguous
    # copy and gives that copy's reference bits; the reference on the permuted layout itself sums
    # across the strided dimension in another order (ATen's outer-sum path), so there it is held
    # to the tolerance of a different summation order (README, "Fidelity").
    x, r, w = _data((512, 40), dtype, 14).t(), _data((512, 40), dtype, 15).t(), _weight(512)
    assert x.stride() == (1, 40)
    assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x.contiguous(), w))
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x.contiguous(), r.contiguous(), w)
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
    for ours, theirs in ((dsnorm.rms_norm(x, w), rms_norm_ref(x, w)), (y, fused_add_rms_norm_ref(x, r, w)[0])):
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=4e-6, atol=0)
        else:
            assert max_ulp(ours, theirs) <= 1
    assert bits_equal(res, fused_add_rms_norm_ref(x, r, w)[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast", ["deepseek", "hf"])
@pytest.mark.parametrize("rounding", ["fp32_sum", "round_first"])
def test_options_match_their_eager_formulas(dtype, cast, rounding):
    x, r, w = _data((9, 769), dtype, 8), _data((9, 769), dtype, 9), _weight(769)
    assert_y_close(dsnorm.rms_norm(x, w, cast=cast), rms_norm_ref(x, w, cast=cast), 769, cast)
    y, res = dsnorm.fused_add_rms_norm(x, r, w, cast=cast, residual_rounding=rounding)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast, residual_rounding=rounding)
    assert bits_equal(res, res_ref)
    assert_y_close(y, y_ref, 769, cast)


def test_round_first_and_hf_differ_from_default():
    # The options are real: on bf16 data they change some bits (else the tests above prove nothing).
    x, r, w = _data((64, 7168), torch.bfloat16, 10), _data((64, 7168), torch.bfloat16, 11), _weight(7168)
    y = dsnorm.fused_add_rms_norm(x, r, w)[0]
    assert not torch.equal(y, dsnorm.fused_add_rms_norm(x, r, w, residual_rounding="round_first")[0])
    assert not torch.equal(y, dsnorm.fused_add_rms_norm(x, r, w, cast="hf")[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp32_residual_stream(dtype):
    x, w = _data((5, 1536), dtype, 12), _weight(1536)
    for r in (_data((5, 1536), torch.float32, 13), _data((5, 1536), dtype, 13)):
        y, res = dsnorm.fused_add_rms_norm(x, r, w, residual_dtype=torch.float32)
        y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, residual_dtype=torch.float32)
        assert res.dtype == torch.float32 and bits_equal(res, res_ref)
        assert_y_close(y, y_ref, 1536)


# x dtype, residual dtype: every pair of two different ones among bf16, fp16, fp32.
MIXED = [(a, b) for a in DTYPES for b in DTYPES if a is not b]


@pytest.mark.parametrize("dtype, res_dtype", MIXED)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 769), (4096, 64)])  # the lane's decode size, the serial
def test_residual_of_another_dtype_is_added_widened(dtype, res_dtype, shape):  # and the threaded kernels
    # The reference adds residual.float() to x.float() whatever the residual's dtype and returns the
    # sum in x.dtype (under torch.autocast the first block's ffn_norm gets a bf16 x and the fp32
    # embedding): the same bits, in both residual roundings and with an fp32 stream.
    x, r, w = _data(shape, dtype, 30), _data(shape, res_dtype, 31, scale=4.0), _weight(shape[-1])
    for rounding, stream in (("fp32_sum", None), ("round_first", None), ("fp32_sum", torch.float32)):
        y, res = dsnorm.fused_add_rms_norm(x, r, w, residual_rounding=rounding, residual_dtype=stream)
        y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, residual_rounding=rounding, residual_dtype=stream)
        assert y.dtype == dtype and res.dtype == (stream or dtype)
        assert bits_equal(res, res_ref)
        assert_y_close(y, y_ref, shape[-1])
    norm, ref = dsnorm.RMSNorm(shape[-1]), RMSNormRef(shape[-1])
    with torch.no_grad():
        norm.weight.copy_(w)
        ref.weight.copy_(w)
        for got, want in zip(norm(x, r), ref(x, r)):
            assert got.dtype == want.dtype and bits_equal(got, want)


def test_first_ffn_norm_under_autocast():
    # Mixed precision with fp32 parameters: the attention's output is bf16 and the residual is the
    # fp32 embedding. The reference runs it; so must the drop-in, with the same outputs.
    g = torch.Generator().manual_seed(32)
    emb = torch.randn(2, 5, 64, generator=g)
    lin = torch.nn.Linear(64, 64)
    norm, ref = dsnorm.RMSNorm(64), RMSNormRef(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(emb)
        (y, res), (y_ref, res_ref) = norm(h, emb), ref(h, emb)
    assert h.dtype == torch.bfloat16 and emb.dtype == torch.float32
    assert res.dtype == res_ref.dtype == torch.bfloat16
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
    (y.float().sum() + res.float().sum()).backward()
    assert lin.weight.grad is not None and norm.weight.grad is not None


def test_residuals_the_fused_form_refuses():
    x, w = _data((2, 64), torch.bfloat16, 33), _weight(64)
    # fp64: the reference rounds it to fp32 before the sum, a rounding the kernels do not make
    with pytest.raises(TypeError, match="residual must be torch.bfloat16 or torch.float32 or torch.float16"):
        dsnorm.fused_add_rms_norm(x, _data((2, 64), torch.float64, 34), w)
    # in place the residual buffer is also the output: x's dtype or an fp32 stream only, eagerly
    # and under fake tensors alike (what torch.compile and torch.export trace with)
    inplace = r"residual must be torch.bfloat16 or torch.float32 \(in place: x's dtype, or an fp32 residual stream\)"
    r16 = _data((2, 64), torch.float16, 35)
    for device in ("cpu", "meta"):
        with pytest.raises(TypeError, match=inplace + ", got torch.float16"):
            dsnorm.fused_add_rms_norm_(x.clone().to(device), r16.to(device), w.to(device))
    # the fusions keep x's dtype
    with pytest.raises(TypeError, match=r"residual must be torch.bfloat16 \(the fusions take x's dtype\)"):
        dsnorm.fused_add_rms_norm_fp8(_data((2, 128), torch.bfloat16, 36), _data((2, 128), torch.float32, 37),
                                      torch.ones(128))


def test_fp64_computed_in_fp64():
    x, r = _data((4, 1536), torch.float64, 14), _data((4, 1536), torch.float64, 15)
    w = _weight(1536).double()
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert y.dtype == torch.float64 and bits_equal(res, res_ref)
    assert_y_close(y, y_ref, 1536)  # bitwise on x86, as every dtype (rtol 1e-14 allowed ~45 ulps)
    assert_y_close(dsnorm.rms_norm(x, w.float()), rms_norm_ref(x, w), 1536)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_weights_upcast_exactly(dtype):
    x, w = _data((3, 1536), torch.bfloat16, 16), _weight(1536).to(dtype)
    # The reference module would hold the same values in fp32.
    assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w.float()))


def test_wide_rows_within_one_ulp(threads):
    # torch splits a single very wide row across threads, changing its own order: <= 1 ulp there.
    torch.set_num_threads(2)
    x, r, w = _data((1, 65536), torch.bfloat16, 17), _data((1, 65536), torch.bfloat16, 18), _weight(65536)
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(res, res_ref)
    assert max_ulp(y, y_ref) <= 1
    xf = x.float()
    torch.testing.assert_close(dsnorm.rms_norm(xf, w), rms_norm_ref(xf, w), rtol=4e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 4096])
def test_many_and_few_rows(rows):
    x, r, w = _data((rows, 512), torch.bfloat16, 19), _data((rows, 512), torch.bfloat16, 20), _weight(512)
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(res, res_ref)
    assert_y_close(y, y_ref, 512)


def test_batch_invariance(threads):
    x, r, w = _data((300, 7168), torch.bfloat16, 21), _data((300, 7168), torch.bfloat16, 22), _weight(7168)
    torch.set_num_threads(2)
    full_y, full_res = dsnorm.fused_add_rms_norm(x, r, w)
    full_plain = dsnorm.rms_norm(x, w)
    for idx in (0, 7, 150, 299):
        for lo, hi in ((idx, idx + 1), (max(0, idx - 3), idx + 1)):
            y, res = dsnorm.fused_add_rms_norm(x[lo:hi], r[lo:hi], w)
            assert bits_equal(y[idx - lo], full_y[idx]) and bits_equal(res[idx - lo], full_res[idx])
            assert bits_equal(dsnorm.rms_norm(x[lo:hi], w)[idx - lo], full_plain[idx])
    # a row placed elsewhere in a bigger batch
    moved = torch.cat([x[150:151], x[:10]])
    assert bits_equal(dsnorm.rms_norm(moved, w)[0], full_plain[150])
    torch.set_num_threads(1)
    y1, res1 = dsnorm.fused_add_rms_norm(x, r, w)
    assert bits_equal(y1, full_y) and bits_equal(res1, full_res)


def test_nan_inf_propagate_and_zero_rows():
    x = _data((4, 111), torch.bfloat16, 23)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2] = 0
    w = _weight(111)
    y, y_ref = dsnorm.rms_norm(x, w), rms_norm_ref(x, w)
    assert bits_equal(y, y_ref)
    assert torch.isnan(y[0]).all() and torch.isnan(y[1]).any()
    assert (y[2] == 0).all() and not torch.isnan(y[2]).any()
    r = torch.zeros_like(x)
    r[3, 0] = float("-inf")
    y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_every_width_below_and_across_the_narrow_sum_bitwise(dtype):
    # Rows of 8 to 543 elements (fp64: 4 to 271; at most 16 groups of 4 vectors) take the register
    # form of the cascade (cascade.sumsq_narrow); every remainder of vectors and elements, the edge
    # past 16 groups (to 20: at 17 both orders happen to agree) and the scalar rows below one
    # vector, plain and fused, with non-finite values in a row of each width (bits_equal holds a
    # NaN to being a NaN, not to its payload). fp64 is held to the reference computed in fp64.
    for width in range(1, 641):
        x, r, w = _data((3, width), dtype, width), _data((3, width), dtype, width + 1), _weight(width, width)
        x[1, width // 2] = float("nan")
        r[2, width - 1] = float("inf")
        assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w)), width
        (y, res), (y_ref, res_ref) = dsnorm.fused_add_rms_norm(x, r, w), fused_add_rms_norm_ref(x, r, w)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref), width


def test_nan_rounds_to_reference_bits():
    # f32 -> bf16 rounds to nearest even (ties, the largest finite value) and keeps a NaN a NaN.
    x = torch.tensor([[float("nan"), 1.0, 3.0, 3.3895e38]], dtype=torch.float32)
    r = torch.tensor([[1.0, 2 ** -9, 2 ** -8 * 3, 3.3895e38]], dtype=torch.float32)
    xb, rb = x.bfloat16(), r.bfloat16()
    res, res_ref = dsnorm.fused_add_rms_norm(xb, rb, torch.ones(4))[1], fused_add_rms_norm_ref(xb, rb, torch.ones(4))[1]
    assert bits_equal(res, res_ref)


def _bits(t):
    return t.view(torch.int16).int() & 0xFFFF


# The output stage's forms and gains: DeepSeek's order, and Hugging Face's with an fp32 gain (rounded
# to bf16 once per call) and with a bf16 one (vLLM's: exact in bf16).
_CASTS_AND_GAINS = [("deepseek", torch.float32), ("hf", torch.float32), ("hf", torch.bfloat16)]


@pytest.mark.parametrize("width", [16, 61, 7168, 7171, 7184])
@pytest.mark.parametrize("cast, gain", _CASTS_AND_GAINS)
def test_bf16_rounding_of_subnormals_and_nans_in_every_lane(width, cast, gain):
    # Where the CPU has AVX512-BF16, bf16 outputs are rounded a vector at a time by instructions
    # that read subnormal inputs as zero and keeps a NaN's sign and payload; such lanes must still
    # get the scalar rule: subnormals rounded to nearest even, every NaN 0x7FC0. Each row puts the
    # special value at another lane (and in the scalar tail of the odd widths). Rows beyond the
    # caches, which take other vector paths: test_rows_beyond_the_caches_bitwise.
    rows = min(width, 24)
    tiny = torch.tensor([3, 5, 0x7F, 0x8001], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = _data((rows, width), torch.bfloat16, width)
    r = _data((rows, width), torch.bfloat16, width + 1)
    for i in range(rows):
        lane = (i * 5 + 3) % width
        x[i, lane], r[i, lane] = tiny[i % 4], tiny[(i + 1) % 4]  # a subnormal sum, kept by torch
    # One huge element over small ones: the rest of that row's y are subnormal in fp32.
    x[0], r[0] = x[0] * 1e-21, r[0] * 1e-21
    x[0, 0], r[0, 0] = 1e19, 0
    x[1, width // 2] = float("nan")
    r[2, -1:].view(torch.int16)[0] = 0xFFC1 - 0x10000  # a NaN with its sign bit and a payload
    x[3, width // 3] = float("inf")  # the row's x̂: inf * 0, a NaN with the sign bit set
    w = _weight(width).to(gain).float()
    res_ref = (x.float() + r.float()).bfloat16()
    for y, res in (dsnorm.fused_add_rms_norm(x, r, w.to(gain), cast=cast),
                   dsnorm.fused_add_rms_norm_(x.clone(), r.clone(), w.to(gain), cast=cast)):
        assert torch.equal(_bits(res)[~res_ref.isnan()], _bits(res_ref)[~res_ref.isnan()])
        assert (_bits(res)[res_ref.isnan()] == 0x7FC0).all()
        y_ref = fused_add_rms_norm_ref(x, r, w, cast=cast)[0]
        assert bits_equal(y, y_ref)
        assert (_bits(y)[y_ref.isnan()] == 0x7FC0).all() and y_ref[1:3].isnan().all() and y_ref[3].isnan().any()
        assert ((y_ref[0, 1:] != 0) & (y_ref[0, 1:].float().abs() < 2 ** -126)).sum() > 0
    y = dsnorm.rms_norm(x, w.to(gain), cast=cast)
    y_ref = rms_norm_ref(x, w, cast=cast)
    assert bits_equal(y, y_ref) and (_bits(y)[y_ref.isnan()] == 0x7FC0).all()


@pytest.mark.parametrize("width", [7168, 7171, 7184])
@pytest.mark.parametrize("cast, gain", _CASTS_AND_GAINS)
def test_rows_beyond_the_caches_bitwise(cast, gain, width, threads):
    # On CPUs with AVX512-BF16, bf16 rows whose thread shares outgrow L2 are summed from the inputs
    # and read again for the outputs instead of through a scratch row, and fresh outputs past 8 MiB
    # a thread, their rows 64-byte aligned (7168 wide), are written with non-temporal stores (in
    # place keeps ordinary ones). Fused rows are read there 32 elements at a time, as their even and
    # odd halves. 7171 wide: the whole level steps, then 3 elements through the scratch row and the
    # scalar tail of the stores; 7184 wide: a tail of 16 past the last 32 (rows 32-byte aligned: the
    # plain rows' stores stream, the fused rows' do not).
    # Two threads: the sizes above are per thread (2400 rows: 17 MB of x each).
    torch.set_num_threads(2)
    x, r = _data((2400, width), torch.bfloat16, 31), _data((2400, width), torch.bfloat16, 32)
    w = _weight(width).to(gain).float()
    tiny = torch.tensor([3, 5, 0x7F, 0x8001], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for i in range(64):  # subnormal sums at every lane of a vector, in the first rows of both threads
        for row in (i, 1200 + i):
            x[row, 7 * i % width], r[row, 7 * i % width] = tiny[i % 4], tiny[(i + 1) % 4]
    x[5, 100], r[7, width - 1], x[2399, 0] = float("nan"), -float("nan"), 1e19
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast)
    for y, res in (dsnorm.fused_add_rms_norm(x, r, w.to(gain), cast=cast),
                   dsnorm.fused_add_rms_norm_(x.clone(), r.clone(), w.to(gain), cast=cast)):
        assert torch.equal(_bits(res)[~res_ref.isnan()], _bits(res_ref)[~res_ref.isnan()])
        assert bits_equal(y, y_ref)
        assert (_bits(res)[res_ref.isnan()] == 0x7FC0).all() and (_bits(y)[y_ref.isnan()] == 0x7FC0).all()
    y, y_ref = dsnorm.rms_norm(x, w.to(gain), cast=cast), rms_norm_ref(x, w, cast=cast)
    assert bits_equal(y, y_ref) and (_bits(y)[y_ref.isnan()] == 0x7FC0).all()


@pytest.mark.parametrize("rows, width", [(3, 61), (3, 7184), (64, 7168)])
@pytest.mark.parametrize("cast, gain", _CASTS_AND_GAINS)
def test_gains_with_infinities_nans_and_overflow_bitwise(cast, gain, rows, width, threads):
    # Where the bit trick rounds (no AVX512-BF16), a row whose sum and gain are finite is rounded
    # without the NaN test: nothing rounded can be NaN there. A gain holding an infinity or a NaN
    # (inf * 0 is NaN: those lanes' inputs are zero) must still give every NaN the bits 0x7FC0, and
    # a huge finite gain overflow to infinity as in the reference. 64 rows: the threaded kernel.
    torch.set_num_threads(2)
    x, r = _data((rows, width), torch.bfloat16, 41), _data((rows, width), torch.bfloat16, 42)
    x[:, 1], r[:, 1] = 0, 0
    x[:, 0], r[:, 0] = 4, 0  # x̂ about 2.8 there
    for special in (None, float("inf"), float("nan")):
        w = _weight(width)
        w[0] = 3e38  # finite, in bf16 too; w * x̂ overflows where |x̂| > 1.14, as in column 0
        if special is not None:
            w[1], w[width // 2] = special, -special
        elif gain is torch.float32:
            w[1] = 3.4e38  # finite in fp32, inf in bf16: cast="hf" rounds it, and x̂ is 0 there
        w = w.to(gain).float()
        y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast)
        hf_overflow = cast == "hf" and gain is torch.float32
        assert y_ref.isinf().any() and y_ref.isnan().any() == (special is not None or hf_overflow)
        for y, res in (dsnorm.fused_add_rms_norm(x, r, w.to(gain), cast=cast),
                       dsnorm.fused_add_rms_norm_(x.clone(), r.clone(), w.to(gain), cast=cast)):
            assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
            assert (_bits(y)[y_ref.isnan()] == 0x7FC0).all()
        y, y_ref = dsnorm.rms_norm(x, w.to(gain), cast=cast), rms_norm_ref(x, w, cast=cast)
        assert bits_equal(y, y_ref) and (_bits(y)[y_ref.isnan()] == 0x7FC0).all()


def test_the_same_bits_on_cpus_without_avx512_bf16(tmp_path):
    # Where the CPU has AVX512-BF16 the bf16 paths differ (the conversion instruction, rows summed
    # and stored without the scratch row, streaming stores); a child process compiling for this CPU
    # less that feature runs what every other x86 CPU runs, and must give the same bits.
    from numba.core.codegen import get_host_cpu_features

    features = get_host_cpu_features()
    if "+avx512bf16" not in features.split(","):
        pytest.skip("this CPU has no AVX512-BF16: what runs here is already the other path")
    script = tmp_path / "cases.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, dsnorm
        torch.manual_seed(0)
        torch.set_num_threads(2)
        out = []
        for rows, width in ((2400, 7168), (64, 7168), (24, 7171), (8, 1536), (3, 600)):
            x = torch.randn(rows, width).bfloat16()
            r = (4 * torch.randn(rows, width)).bfloat16()
            x[0, 1], r[0, 1] = 1e-39, 2e-39  # a subnormal sum
            x[-1, 3] = float("nan")
            special = 1 + 0.1 * torch.randn(width)
            special[1], special[-1] = float("inf"), float("nan")  # finite rows, NaNs in y
            for w in (1 + 0.1 * torch.randn(width), (1 + 0.1 * torch.randn(width)).bfloat16(), special):
                for cast in ("deepseek", "hf"):
                    out += [dsnorm.rms_norm(x, w, cast=cast), *dsnorm.fused_add_rms_norm(x, r, w, cast=cast)]
                    xi, ri = x.clone(), r.clone()
                    dsnorm.fused_add_rms_norm_(xi, ri, w, cast=cast)
                    out += [xi, ri]
        torch.save([t.view(torch.int16) for t in out], sys.argv[1])
    """))
    env = dict(os.environ, NUMBA_CPU_FEATURES=features.replace("+avx512bf16", "-avx512bf16"),
               NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    subprocess.run([sys.executable, str(script), str(tmp_path / "without.pt")], env=env, check=True)
    subprocess.run([sys.executable, str(script), str(tmp_path / "with.pt")], check=True)
    with_, without = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert len(with_) == len(without) == 5 * 3 * 2 * 5
    for k, (a, b) in enumerate(zip(with_, without)):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("shape", [(0, 7168), (2, 0, 512), (0,)])
def test_empty_inputs(shape):
    n = shape[-1] if shape[-1] else 4
    if shape == (0,):
        with pytest.raises(ValueError, match="x must have a last dimension"):
            dsnorm.rms_norm(torch.empty(shape), torch.ones(1))
        return
    x = torch.empty(shape, dtype=torch.bfloat16)
    w = torch.ones(n)
    assert dsnorm.rms_norm(x, w).shape == shape
    y, res = dsnorm.fused_add_rms_norm(x, x.clone(), w)
    assert y.shape == shape and res.shape == shape
    xg = x.float().requires_grad_()
    dsnorm.rms_norm(xg, w).sum().backward()
    assert xg.grad.shape == shape


def test_fresh_outputs_alias_nothing():
    x, r, w = _data((64, 7168), torch.bfloat16, 24), _data((64, 7168), torch.bfloat16, 25), _weight(7168)
    seen = {x.data_ptr(), r.data_ptr()}
    kept = []
    for _ in range(3):
        y, res = dsnorm.fused_add_rms_norm(x, r, w)
        assert y.data_ptr() not in seen and res.data_ptr() not in seen
        assert y.untyped_storage().data_ptr() != res.untyped_storage().data_ptr()
        seen |= {y.data_ptr(), res.data_ptr()}
        kept.append((y, res))
    # outputs held by the caller are never rewritten by later calls
    first = kept[0][0].clone()
    dsnorm.fused_add_rms_norm(r, x, w)
    assert torch.equal(kept[0][0], first)


def test_hf_cast_matches_transformers_bitwise():
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    hf = modeling.DeepseekV3RMSNorm(1536, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(_weight(1536))
    hf = hf.to(torch.bfloat16)  # a model loaded in bf16: its gain is bf16 too
    ours = dsnorm.RMSNorm(1536, cast="hf")
    with torch.no_grad():
        ours.weight.copy_(hf.weight.float())
    x = _data((4, 2, 1536), torch.bfloat16, 26, scale=3.0)
    with torch.no_grad():
        y_hf, y = hf(x), ours(x)
        assert y_hf.dtype == y.dtype == torch.bfloat16
        assert bits_equal(y, y_hf)
        # ...and the default cast differs from Hugging Face's on the same data
        ours.cast = "deepseek"
        assert not torch.equal(ours(x), y_hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_decoder_residual_add_is_hf_cast_with_round_first(dtype):
    # A Hugging Face decoder layer adds the residual in the model's dtype, then normalises:
    # ``residual = residual + h; y = norm(residual)``. That is the fused form with both named
    # options, bit for bit (docs/semantics.md, "Compatibility options"); the defaults differ.
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    hf = modeling.DeepseekV3RMSNorm(769, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(_weight(769))
    hf = hf.to(dtype)
    h, r = _data((6, 769), dtype, 27, scale=3.0), _data((6, 769), dtype, 28, scale=3.0)
    with torch.no_grad():
        stream = r + h
        want = hf(stream)
        y, res = dsnorm.fused_add_rms_norm(h, r, hf.weight.float(), cast="hf", residual_rounding="round_first")
        assert bits_equal(res, stream) and bits_equal(y, want)
        assert not torch.equal(dsnorm.fused_add_rms_norm(h, r, hf.weight.float())[0], want)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_from_dram_prefetching_path(dtype, threads):
    # Large enough that each thread's share of x passes kernels._PREFETCH_MIN_BYTES: the store pass
    # then prefetches the next row. Every form, a strided x and the fp32 residual stream.
    from dsnorm.cpu import kernels

    n = 7168
    rows = -(-kernels._PREFETCH_MIN_BYTES * threads // (n * dtype.itemsize)) + 8
    assert n >= kernels._PREFETCH_MIN_WIDTH
    x, r, w = _data((rows, n), dtype, 5), _data((rows, n), dtype, 6), _weight(n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w))
        wide = _data((rows, n + 32), dtype, 7)
        assert bits_equal(dsnorm.rms_norm(wide[:, :n], w), rms_norm_ref(wide[:, :n], w))
        for cast, rounding in (("deepseek", "fp32_sum"), ("hf", "round_first")):
            y, res = dsnorm.fused_add_rms_norm(x, r, w, cast=cast, residual_rounding=rounding)
            y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast, residual_rounding=rounding)
            assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
            xi, ri = x.clone(), r.clone()
            with torch.no_grad():
                dsnorm.fused_add_rms_norm_(xi, ri, w, cast=cast, residual_rounding=rounding)
            assert bits_equal(xi, y_ref) and bits_equal(ri, res_ref)
        r32 = r.float()
        y, res = dsnorm.fused_add_rms_norm(x, r32, w, residual_dtype=torch.float32)
        y_ref, res_ref = fused_add_rms_norm_ref(x, r32, w, residual_dtype=torch.float32)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_rows_from_l3_prefetching_path(dtype, threads):
    # In place, rows of at least kernels._PREFETCH_IN_PLACE_MIN_WIDTH elements prefetch from a thread's
    # share of x of _PREFETCH_IN_PLACE_MIN_BYTES on, below _PREFETCH_MIN_BYTES: the chunked store
    # pass at a width that is a whole number of chunks and at one that ends in a partial chunk, the
    # fp32 residual stream too. Through the launcher, as the public in-place function's general path
    # calls it.
    from dsnorm.cpu import kernels, launch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (kernels._PREFETCH_IN_PLACE_MIN_WIDTH, 5125, 7168):
            rows = -(-kernels._PREFETCH_IN_PLACE_MIN_BYTES * threads // (n * dtype.itemsize)) + 2
            # Every thread's share (rows * t // threads onward) is in the new range: the smallest
            # reaches the in-place threshold, the largest stays below the general one.
            row_bytes = n * dtype.itemsize
            assert (rows // threads) * row_bytes >= kernels._PREFETCH_IN_PLACE_MIN_BYTES
            assert -(-rows // threads) * row_bytes < kernels._PREFETCH_MIN_BYTES
            x, r, w = _data((rows, n), dtype, 40), _data((rows, n), dtype, 41), _weight(n)
            for cast, rounding in (("deepseek", "fp32_sum"), ("hf", "round_first")):
                y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast, residual_rounding=rounding)
                xi, ri = x.clone(), r.clone()
                launch.forward(xi, ri, w, 1e-6, cast == "hf", rounding == "round_first", xi, ri, None)
                assert bits_equal(xi, y_ref) and bits_equal(ri, res_ref)
            r32 = r.float()
            y_ref, res_ref = fused_add_rms_norm_ref(x, r32, w, residual_dtype=torch.float32)
            xi = x.clone()
            launch.forward(xi, r32, w, 1e-6, False, False, xi, r32, None)
            assert bits_equal(xi, y_ref) and bits_equal(r32, res_ref)
    finally:
        torch.set_num_threads(before)


def test_large_outputs_start_on_a_huge_page():
    # Outputs of 4 MiB or more begin on a 2 MiB boundary (so every page of them can be a huge
    # page) and are otherwise ordinary fresh tensors: not views, contiguous, their own storage.
    from dsnorm.cpu import alloc

    if alloc._madvise is None:
        pytest.skip("no madvise (not Linux/glibc): outputs are plain allocations")
    shape = (2, 1100, 1024)  # 4.3 MiB in bf16, not a whole number of huge pages
    x, r, w = _data(shape, torch.bfloat16, 26), _data(shape, torch.bfloat16, 27), _weight(1024)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    outs = (*dsnorm.fused_add_rms_norm(x, r, w), dsnorm.rms_norm(x, w))
    for out, ref in zip(outs, (y_ref, res_ref, rms_norm_ref(x, w))):
        assert out.data_ptr() % alloc._HUGE_PAGE == 0
        assert out.shape == shape and out.is_contiguous() and out._base is None and not out._is_view()
        assert bits_equal(out, ref)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 3
    outs[0].resize_(3, 5)  # shrinks; growing is refused, as for any tensor made from numpy
    small = dsnorm.rms_norm(x[:, :10], w)  # below 4 MiB: a plain allocation
    assert small.storage_offset() == 0 and small.untyped_storage().nbytes() == small.nbytes


# Kills: the aligned output as a slice of its allocation's storage: torch.save, pickle and
# share_memory_ copy a tensor's whole storage, and wrote the 2 MiB of alignment slack with it
# (a 4.3 MiB output saved as 6.3 MiB).
def test_large_output_storage_is_exactly_its_data():
    import io
    import pickle

    shape = (2, 1100, 1024)
    x, r, w = _data(shape, torch.bfloat16, 30), _data(shape, torch.bfloat16, 31), _weight(1024)
    for y in (dsnorm.rms_norm(x, w), *dsnorm.fused_add_rms_norm(x, r, w)):
        assert y.storage_offset() == 0 and y.untyped_storage().nbytes() == y.nbytes
        buf = io.BytesIO()
        torch.save(y, buf)
        assert buf.tell() < y.nbytes + (64 << 10)
        assert len(pickle.dumps(y)) < y.nbytes + (64 << 10)
        back = torch.load(io.BytesIO(buf.getvalue()))
        assert bits_equal(back, y)
    # The allocation outlives every other reference to it: the output alone keeps it.
    y = dsnorm.rms_norm(x, w)
    gc_before = y.clone()
    import gc

    gc.collect()
    junk = [torch.full((x.numel() * 2 + (2 << 20),), 0x5A, dtype=torch.uint8) for _ in range(3)]
    del junk
    assert bits_equal(y, gc_before)


def test_deterministic_fill_mode_gets_plain_outputs():
    # torch.use_deterministic_algorithms fills new memory; outputs then come from torch as usual.
    shape = (2, 1100, 1024)
    x, w = _data(shape, torch.bfloat16, 31), _weight(1024)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        y = dsnorm.rms_norm(x, w)
    finally:
        torch.use_deterministic_algorithms(before)
    assert y.storage_offset() == 0 and y.untyped_storage().nbytes() == y.nbytes
    assert bits_equal(y, rms_norm_ref(x, w))


@pytest.mark.parametrize("width", [2048, 2049, 16383])
def test_decode_scratch_on_stack_and_heap(width):
    # One row below the serial size: the decode kernel keeps its scratch row on the stack up to
    # kernels._STACK_SCRATCH floats and on the heap beyond; both sides of the boundary, bitwise.
    from dsnorm.cpu import cascade, kernels

    assert (width + cascade.ACC_SLOTS <= kernels._STACK_SCRATCH) == (width == 2048)
    x, r, w = _data((1, width), torch.bfloat16, 28), _data((1, width), torch.bfloat16, 29), _weight(width)
    with torch.no_grad():
        assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w))
        y, res = dsnorm.fused_add_rms_norm(x, r, w)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


@pytest.mark.parametrize("width", [1536, 2048, 7168, 8192])
def test_decode_in_a_thread_with_the_smallest_stack(width):
    # threading.stack_size's minimum (32 KiB): the decode kernel's stack scratch must fit in it.
    script = textwrap.dedent(f"""
        import threading, torch, dsnorm
        from dsnorm.ref import rms_norm_ref
        x, w = torch.randn(1, {width}, dtype=torch.bfloat16), torch.rand({width})
        with torch.no_grad():
            dsnorm.rms_norm(x, w)  # compile in the main thread
        threading.stack_size(32 * 1024)
        out = []
        def run():
            with torch.no_grad():
                out.append(torch.equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w)))
        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert out == [True], out
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
