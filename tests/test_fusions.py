"""The inference fusions on CPU (numba) against eager compositions of the reference.

* fp8: ``rms_norm_fp8`` / ``fused_add_rms_norm_fp8`` bitwise equal to
  ``act_quant_ref(rms_norm_ref(...))`` (q, scales, residual_out, y), and the kernels' fp32 ->
  e4m3fn conversion and ue8m0 rounding against torch / exact oracles over many values.
* ``final_norm`` bitwise equal to ``fused_add_rms_norm_ref(h, residual)[i][:, -1]`` (or at
  ``lengths - 1``); ``mla_latent_norms`` bitwise equal to the two separate norms.
* Ops pass ``torch.library.opcheck``; bad input raises errors naming the argument.
"""

import ast
import hashlib
import importlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import dsnorm
from dsnorm import fusions
from dsnorm.cpu import fusion_kernels
from dsnorm.fusions import (
    act_quant_ref,
    final_norm,
    fused_add_rms_norm_fp8,
    fused_add_rms_norm_fp8_ref,
    mla_latent_norms,
    rms_norm_fp8,
    rms_norm_fp8_ref,
)
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref

from conftest import bits_equal, bitwise_expected

EPS = 1e-6
FP8_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

pytestmark = pytest.mark.skipif(not bitwise_expected(7168), reason="bitwise equality needs torch's x86 sum order")


def fp8_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float8_e4m3fn bits equal, except that a NaN (0x7F / 0xFF) only has to be a NaN."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == b.shape
    ab, bb = a.view(torch.uint8), b.view(torch.uint8)
    nan_a, nan_b = (ab & 0x7F) == 0x7F, (bb & 0x7F) == 0x7F
    return torch.equal(nan_a, nan_b) and torch.equal(ab[~nan_a], bb[~nan_b])


def gen_of(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def block_weight(n, gen, block=128):
    """A weight whose blocks span magnitudes 2^-24 .. 2^12 (so y's blocks do too), including a zero
    block (amax below the 1e-4 floor) and blocks scaled by exact powers of two."""
    scales = torch.tensor([2.0 ** k for k in range(-24, 13, 3)] + [0.0, 1e-5, 448.0, 1.0], dtype=torch.float64)
    per_block = scales[torch.arange(n // block) % len(scales)]
    w = (1.0 + 0.25 * torch.randn(n, generator=gen, dtype=torch.float64)) * per_block.repeat_interleave(block)
    return w.float()


# ---------------------------------------------------------------------------------------------
# The conversions.


def _patterns() -> np.ndarray:
    """fp32 patterns: every sign/exponent/top-7-mantissa-bit combination with the low 16 bits at
    0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF (ties of every rounding position of e4m3fn's normal and
    subnormal ranges, just around them, and exact values), plus 2^20 random patterns."""
    hi = np.arange(1 << 16, dtype=np.uint64) << np.uint64(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint64)
    pats = (hi[:, None] | lows[None, :]).reshape(-1)
    rand = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64)
    return np.concatenate([pats, rand]).astype(np.uint32).view(np.float32)


def test_e4m3_conversion_matches_torch():
    v = _patterns()
    got = fusion_kernels.e4m3_bits(v)
    t = torch.from_numpy(v)
    # The reference's clamp then cast (the kernels fold the clamp into a saturating conversion).
    want = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {v.size} differ"
    # Where no clamp applies, the conversion is torch's own, NaN sign included.
    small = ~(np.abs(v) > 448)
    assert np.array_equal(got[small], t[torch.from_numpy(small)].to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    # The set holds what it claims: ties in e4m3fn's subnormal range (k * 2^-9) and normal range.
    a = np.abs(v[np.isfinite(v)]).astype(np.float64)
    assert np.any((a < 2.0**-6) & (a > 0) & (np.mod(a * 2**9, 1.0) == 0.5))
    assert np.any((a >= 2.0**-6) & (a < 448) & (np.mod(a / 2.0 ** np.floor(np.log2(np.maximum(a, 1e-300))) * 8, 1) == 0.5))
    assert np.isnan(v).sum() > 1000 and np.isinf(v).any() and (v == 0).any()
    nan_bits = got[np.isnan(v)]
    assert set(np.unique(nan_bits).tolist()) == {0x7F, 0xFF}


def _ue8m0_oracle(values: np.ndarray) -> np.ndarray:
    """2^ceil(log2 v) in Python's double precision (exact for an fp32 v: log2 of a power of two is
    exact, and of anything above one it is above the integer)."""
    return np.array([2.0 ** math.ceil(math.log2(float(x))) for x in values], dtype=np.float64).astype(np.float32)


def test_ue8m0_rounding():
    rng = np.random.default_rng(1)
    powers = np.float32(2.0) ** np.arange(-40, 40, dtype=np.float32)
    ulp_above = np.nextafter(powers, np.float32(np.inf))
    ulp_below = np.nextafter(powers, np.float32(0))
    rand = (rng.random(20000) * 10.0 ** rng.integers(-9, 9, 20000)).astype(np.float32)
    v = np.concatenate([powers, ulp_above, ulp_below, rand[rand > 0]])
    want = _ue8m0_oracle(v)
    assert np.array_equal(fusion_kernels.ue8m0_scales(v), want)
    # The reference (frexp) agrees; log2 in fp32 does not (the reason it is not used).
    t = torch.from_numpy(v)
    mant, exp = torch.frexp(t)
    ref = torch.ldexp(torch.ones_like(t), torch.where(mant == 0.5, exp - 1, exp))
    assert np.array_equal(ref.numpy(), want)
    naive = torch.exp2(torch.ceil(torch.log2(t)))
    assert not torch.equal(naive, torch.from_numpy(want))
    special = np.array([np.inf, np.nan], dtype=np.float32)
    out = fusion_kernels.ue8m0_scales(special)
    assert np.isinf(out[0]) and np.isnan(out[1])


def test_scale_is_fp32_multiply_by_fp32_reciprocal():
    # act_quant's s = amax * (1/448): in torch an fp32 tensor times a Python float multiplies by
    # fp32(1/448). That is not amax / 448 for every amax: the choice is observable and fixed here.
    amax = torch.from_numpy(np.random.default_rng(2).random(1 << 16).astype(np.float32) * 500 + 1e-4)
    literal = amax * (1.0 / 448)
    explicit = amax * torch.tensor(1.0 / 448, dtype=torch.float32)
    assert torch.equal(literal, explicit)
    assert int((literal != amax / 448).sum()) > 0
    # act_quant_ref uses it: one element per block, so amax is that element.
    q, s = act_quant_ref(amax.view(-1, 1).expand(-1, 16).contiguous(), 16)
    assert torch.equal(s.view(-1), literal)  # every amax here is above the 1e-4 floor


def test_act_quant_ref_semantics():
    # Spelled out on one block: amax, the 1e-4 floor, the clamp, ue8m0.
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -448.0 * 2, 1.0
    x[1] = 1e-6
    q, s = act_quant_ref(x, 128)
    s0 = torch.tensor(896.0) * torch.tensor(1 / 448, dtype=torch.float32)
    assert s[0, 0] == s0 and s[1, 0] == torch.tensor(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    assert q[0, 1].float() == -448 and q[0, 0].float() == (3.0 / s0).to(torch.float8_e4m3fn).float()
    qu, su = act_quant_ref(x, 128, "ue8m0")
    assert su[0, 0] == 2.0 and qu[0, 1].float() == -448 and qu[0, 0].float() == 1.5
    assert su[1, 0] == 2.0 ** math.ceil(math.log2(float(s[1, 0])))


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


def _assert_fp8_matches(got, ref, with_residual):
    q, s = got[0], got[1]
    assert fp8_equal(q, ref[0])
    assert bits_equal(s, ref[1])
    if with_residual:
        assert bits_equal(got[2], ref[2])
    assert bits_equal(got[-1], ref[-1])


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("shape", [(3, 7168), (2, 5, 1536), (12, 7168)])  # the last runs in parallel
def test_fp8_bitwise(dtype, scale_fmt, shape):
    gen = gen_of(hash((shape, str(dtype))) % 1000)
    n = shape[-1]
    x = randn(shape, dtype, gen)
    r = randn(shape, dtype, gen, 4.0)
    w = block_weight(n, gen)
    got = rms_norm_fp8(x, w, scale_fmt=scale_fmt, return_normed=True)
    _assert_fp8_matches(got, rms_norm_fp8_ref(x, w, scale_fmt=scale_fmt), False)
    assert bits_equal(got[2], dsnorm.rms_norm(x, w))  # y is the core's output
    got = fused_add_rms_norm_fp8(x, r, w, scale_fmt=scale_fmt, return_normed=True)
    ref = fused_add_rms_norm_fp8_ref(x, r, w, scale_fmt=scale_fmt)
    _assert_fp8_matches(got, ref, True)
    y_core, r_core = dsnorm.fused_add_rms_norm(x, r, w)
    assert bits_equal(got[3], y_core) and bits_equal(got[2], r_core)
    # Without y, the same q and scales (y then lives in scratch only).
    q, s, ro = fused_add_rms_norm_fp8(x, r, w, scale_fmt=scale_fmt)
    assert fp8_equal(q, got[0]) and bits_equal(s, got[1]) and bits_equal(ro, got[2])
    q, s = rms_norm_fp8(x, w, scale_fmt=scale_fmt)
    assert q.shape == shape and s.shape == (*shape[:-1], n // 128) and s.dtype == torch.float32


def test_fp8_reads_y_rounded_to_x_dtype():
    # Quantising the fp32 value before its bf16 rounding would give other bits: the rounding is
    # what makes the fused result equal the two-step model.
    gen = gen_of(4)
    x, w = randn((8, 1536), torch.bfloat16, gen), block_weight(1536, gen)
    q, s = rms_norm_fp8(x, w, scale_fmt=None)
    xf = x.float()
    y32 = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS))
    q32, s32 = act_quant_ref(y32, 128)
    assert not (fp8_equal(q, q32) and torch.equal(s, s32))
    assert fp8_equal(q, act_quant_ref(rms_norm_ref(x, w), 128)[0])


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_fp8_block_sizes_and_strided_rows(block_size):
    gen = gen_of(block_size)
    parent = randn((3, 4, 576), torch.bfloat16, gen)
    x = parent[..., :512]  # strided rows, read in place
    r = randn((3, 4, 512), torch.bfloat16, gen)
    w = block_weight(512, gen, block_size)
    for fmt in (None, "ue8m0"):
        got = fused_add_rms_norm_fp8(x, r, w, scale_fmt=fmt, block_size=block_size, return_normed=True)
        _assert_fp8_matches(got, fused_add_rms_norm_fp8_ref(x, r, w, scale_fmt=fmt, block_size=block_size), True)
    # bf16 weights are widened exactly, as in the core API.
    wb = w.to(torch.bfloat16)
    _assert_fp8_matches(rms_norm_fp8(x, wb, block_size=block_size, return_normed=True),
                        rms_norm_fp8_ref(x, wb, block_size=block_size), False)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp8_extremes():
    # A NaN (whole row NaN), a NaN weight column (one block NaN), a zero row (amax floor),
    # y overflowing bf16 (inf in a block: scale inf, q NaN there and 0 elsewhere), tiny values
    # that quantise to e4m3fn subnormals.
    n = 512
    gen = gen_of(9)
    x = randn((6, n), torch.bfloat16, gen)
    x[0, 7] = float("nan")
    x[1] = 0.0
    x[3, 0] = 100.0
    x[3, 1:8] = 100.0 * 2.0**-17 * torch.arange(1, 8)  # y / s ~ 0.0034 k: e4m3fn subnormals
    x[2, 140] = 50.0
    w = block_weight(n, gen)
    w[:128] = 1.0
    w[300] = float("nan")
    w[140] = 3e38  # y[2, 140] overflows bf16
    for fmt in (None, "ue8m0"):
        got = rms_norm_fp8(x, w, scale_fmt=fmt, return_normed=True)
        _assert_fp8_matches(got, rms_norm_fp8_ref(x, w, scale_fmt=fmt), False)
        q, s, y = got
        assert bool(s[0].isnan().all()) and bool(q[0].float().isnan().all())
        assert bool(s[2, 2].isnan()) and bool(s[2, 1].isinf())
    assert bool((q[1, :256].float() == 0).all()) and bool((s[1, :2] > 0).all())  # the zero row, bar the NaN block
    sub = q[3, 1:5].view(torch.uint8)  # k = 1..4; 5..7 are normal
    assert bool(((sub & 0x78) == 0).all()) and bool((sub != 0).all())  # e4m3fn subnormal codes


def test_fp8_thread_count_invariant(threads):
    gen = gen_of(11)
    x, r = randn((40, 1536), torch.bfloat16, gen), randn((40, 1536), torch.bfloat16, gen)
    w = block_weight(1536, gen)
    torch.set_num_threads(1)
    one = fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0", return_normed=True)
    torch.set_num_threads(2)
    two = fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0", return_normed=True)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(one, two))


def test_fp8_errors():
    gen = gen_of(12)
    x, r, w = randn((2, 256), torch.bfloat16, gen), randn((2, 256), torch.bfloat16, gen), torch.ones(256)
    r_before = r.clone()
    with pytest.raises(ValueError, match="block_size=128"):
        rms_norm_fp8(randn((2, 200), torch.bfloat16, gen), torch.ones(200))
    with pytest.raises(ValueError, match="scale_fmt"):
        rms_norm_fp8(x, w, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="block_size"):
        rms_norm_fp8(x, w, block_size=96)
    with pytest.raises(TypeError, match="block_size"):
        rms_norm_fp8(x, w, block_size=128.0)
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        rms_norm_fp8(x.double(), w)
    with pytest.raises(TypeError, match="residual"):
        fused_add_rms_norm_fp8(x, r.float(), w)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_fp8(x, r[:1], w)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fp8(x, torch.ones(128))
    with pytest.raises(ValueError, match="eps"):
        fused_add_rms_norm_fp8(x, r, w, eps=-1.0)
    with pytest.raises(TypeError, match="return_normed"):
        rms_norm_fp8(x, w, return_normed=1)
    with pytest.raises(ValueError, match="cast"):  # inference paths use DeepSeek's cast only
        rms_norm_fp8(x, w, cast="hf")
    with pytest.raises(ValueError, match="residual_rounding"):
        fused_add_rms_norm_fp8(x, r, w, residual_rounding="round_first")
    assert torch.equal(r, r_before)
    xg = x.float().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        rms_norm_fp8(xg, w)
    with pytest.raises(RuntimeError, match="inference-only"):
        fused_add_rms_norm_fp8(x, r, torch.nn.Parameter(w))
    with torch.no_grad():  # model weights are Parameters: fine without grad mode
        q, s, ro = fused_add_rms_norm_fp8(x, r, torch.nn.Parameter(w))
    assert fp8_equal(q, fused_add_rms_norm_fp8_ref(x, r, w)[0])


# ---------------------------------------------------------------------------------------------
# Final norm.


@pytest.mark.parametrize("dtype,batch,seq,n", [
    (torch.bfloat16, 3, 7, 512), (torch.float32, 3, 7, 512), (torch.float64, 3, 7, 512),
    (torch.bfloat16, 12, 3, 7168), (torch.float32, 12, 3, 7168),  # parallel (fp64 there would only add a compile)
])
def test_final_norm_bitwise(dtype, batch, seq, n):
    gen = gen_of(batch * seq)
    h, r = randn((batch, seq, n), dtype, gen), randn((batch, seq, n), dtype, gen, 4.0)
    w = randn((n,), torch.float64 if dtype == torch.float64 else torch.float32, gen)
    y_ref, r_ref = fused_add_rms_norm_ref(h, r, w)
    y, ro = final_norm(h, r, w)
    assert y.shape == (batch, n) and ro.shape == (batch, n)
    assert bits_equal(y, y_ref[:, -1]) and bits_equal(ro, r_ref[:, -1])
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    lengths[-1] = 1
    rows = torch.arange(batch)
    for lens in (lengths, lengths.to(torch.int32)):
        y, ro = final_norm(h, r, w, lengths=lens)
        assert bits_equal(y, y_ref[rows, lengths - 1]) and bits_equal(ro, r_ref[rows, lengths - 1])
    y_full, r_full = final_norm(h, r, w, last_only=False)
    assert y_full.shape == h.shape and bits_equal(y_full, y_ref) and bits_equal(r_full, r_ref)


def test_final_norm_launches_from_the_lengths_it_checked(monkeypatch):
    # The kernel reads h at lengths[b] - 1 unchecked. It read the caller's tensor again after the
    # check, so a value written in between (another thread reusing the buffer) was used unchecked:
    # out of bounds, a segfault (found by a concurrency review). Here the "other thread" writes a
    # valid but different value right after the check: the result must be for the values checked.
    gen = gen_of(5)
    h, r = randn((3, 5, 512), torch.bfloat16, gen), randn((3, 5, 512), torch.bfloat16, gen)
    w = randn((512,), torch.float32, gen)
    lengths = torch.tensor([5, 3, 2])
    y_ref, r_ref = fused_add_rms_norm_ref(h, r, w)
    check = fusions._check_lengths_values

    def check_then_rewrite(lens, seq):
        check(lens, seq)
        lengths.fill_(1)

    monkeypatch.setattr(fusions, "_check_lengths_values", check_then_rewrite)
    y, ro = final_norm(h, r, w, lengths=lengths)
    rows, want = torch.arange(3), torch.tensor([5, 3, 2])
    assert bits_equal(y, y_ref[rows, want - 1]) and bits_equal(ro, r_ref[rows, want - 1])


def test_final_norm_strided_h():
    # h as a [B, T, d] view of a [T, B, d] buffer, residual with padded rows: read in place.
    gen = gen_of(21)
    h = randn((6, 3, 1536), torch.bfloat16, gen).transpose(0, 1)
    r = randn((3, 6, 1600), torch.bfloat16, gen)[..., :1536]
    w = randn((1536,), torch.float32, gen)
    y_ref, r_ref = fused_add_rms_norm_ref(h, r, w)
    y, ro = final_norm(h, r, w)
    assert bits_equal(y, y_ref[:, -1]) and bits_equal(ro, r_ref[:, -1])
    lengths = torch.tensor([2, 6, 1])
    y, ro = final_norm(h, r, w, lengths=lengths)
    rows = torch.arange(3)
    assert bits_equal(y, y_ref[rows, lengths - 1]) and bits_equal(ro, r_ref[rows, lengths - 1])


def test_final_norm_errors():
    gen = gen_of(22)
    h, r, w = randn((2, 4, 64), torch.bfloat16, gen), randn((2, 4, 64), torch.bfloat16, gen), torch.ones(64)
    for bad, exc, match in [
        (torch.tensor([0, 4]), ValueError, r"lengths must be in \[1, 4\]"),
        (torch.tensor([1, 5]), ValueError, r"lengths must be in \[1, 4\]"),
        (torch.tensor([1.0, 2.0]), TypeError, "integer"),
        (torch.tensor([True, True]), TypeError, "integer"),
        (torch.tensor([1, 2, 3]), ValueError, r"shape \(2,\)"),
        ([1, 2], TypeError, "lengths must be a torch.Tensor"),
    ]:
        with pytest.raises(exc, match=match):
            final_norm(h, r, w, lengths=bad)
    with pytest.raises(ValueError, match="last_only=True"):
        final_norm(h, r, w, last_only=False, lengths=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="3-D"):
        final_norm(h[0], r[0], w)
    with pytest.raises(ValueError, match="at least one position"):
        final_norm(h[:, :0], r[:, :0], w)
    with pytest.raises(TypeError, match="residual"):
        final_norm(h, r.float(), w)
    with pytest.raises(TypeError, match="last_only"):
        final_norm(h, r, w, last_only="yes")
    # Errors name final_norm's own arguments (h), not the core's (x).
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        final_norm([1.0], r, w)
    with pytest.raises(ValueError, match=r"residual must have h's shape \(2, 4, 64\)"):
        final_norm(h, r[:, :1], w)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\) to match h's last dimension"):
        final_norm(h, r, torch.ones(5))
    with pytest.raises(RuntimeError, match="inference-only"):
        final_norm(h.float().requires_grad_(), r.float(), w)


# ---------------------------------------------------------------------------------------------
# MLA latents.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lead", [(1,), (3, 5), (64,)])  # (64,) runs in parallel
def test_mla_latent_norms_bitwise(dtype, lead):
    gen = gen_of(len(lead) * 100 + lead[-1])
    q = randn((*lead, 1536), dtype, gen)
    kv_a = randn((*lead, 576), dtype, gen)
    kv_before = kv_a.clone()
    wq, wkv = randn((1536,), torch.float32, gen), randn((512,), torch.float32, gen)
    qn, kvn = mla_latent_norms(q, kv_a, wq, wkv)
    assert qn.shape == q.shape and kvn.shape == (*lead, 512) and kvn.is_contiguous()
    assert bits_equal(qn, rms_norm_ref(q, wq)) and bits_equal(kvn, rms_norm_ref(kv_a[..., :512], wkv))
    assert bits_equal(qn, dsnorm.rms_norm(q, wq)) and bits_equal(kvn, dsnorm.rms_norm(kv_a[..., :512], wkv))
    assert torch.equal(kv_a.view(torch.uint8), kv_before.view(torch.uint8))  # rotary columns and all untouched


def test_mla_latent_norms_strided_and_errors():
    gen = gen_of(31)
    q = randn((4, 1600), torch.bfloat16, gen)[:, :1536]
    kv_a = randn((4, 576), torch.bfloat16, gen)
    wq, wkv = randn((1536,), torch.float32, gen), randn((512,), torch.float32, gen)
    qn, kvn = mla_latent_norms(q, kv_a, wq.to(torch.bfloat16), wkv)
    assert bits_equal(qn, rms_norm_ref(q, wq.to(torch.bfloat16))) and bits_equal(kvn, rms_norm_ref(kv_a[:, :512], wkv))
    with pytest.raises(ValueError, match="kv_weight"):
        mla_latent_norms(q, kv_a, wq, torch.ones(600))
    with pytest.raises(ValueError, match="q_weight"):
        mla_latent_norms(q, kv_a, torch.ones(512), wkv)
    with pytest.raises(ValueError, match="leading shape"):
        mla_latent_norms(q, kv_a[:3], wq, wkv)
    with pytest.raises(TypeError, match="kv_a must have q_latent's dtype"):
        mla_latent_norms(q, kv_a.float(), wq, wkv)
    with pytest.raises(TypeError, match="kv_a must be a torch.Tensor"):
        mla_latent_norms(q, None, wq, wkv)
    # Errors say which gain (q_weight or kv_weight) and q_latent, not the core's weight and x.
    with pytest.raises(TypeError, match="q_latent must be a torch.Tensor"):
        mla_latent_norms([1.0], kv_a, wq, wkv)
    with pytest.raises(TypeError, match="kv_weight must be a torch.Tensor"):
        mla_latent_norms(q, kv_a, wq, [1.0] * 512)
    with pytest.raises(TypeError, match="kv_weight must be float32, bfloat16, float16 or float64, got torch.int32"):
        mla_latent_norms(q, kv_a, wq, wkv.int())
    with pytest.raises(TypeError, match="q_weight must be a dense"):
        mla_latent_norms(q, kv_a, wq.to_sparse(), wkv)
    with pytest.raises(RuntimeError, match="inference-only"):
        mla_latent_norms(q.float().requires_grad_(), kv_a.float(), wq, wkv)


# ---------------------------------------------------------------------------------------------
# Ops.


def test_opcheck():
    gen = gen_of(41)
    x, r = randn((3, 256), torch.bfloat16, gen), randn((3, 256), torch.bfloat16, gen)
    w = randn((256,), torch.float32, gen)
    ops = torch.ops.dsnorm
    torch.library.opcheck(ops.rms_norm_fp8, (x, w, EPS, "ue8m0", 128, True))
    torch.library.opcheck(ops.rms_norm_fp8, (x, w, EPS, None, 64, False))
    torch.library.opcheck(ops.fused_add_rms_norm_fp8, (x, r, w, EPS, None, 128, True))
    h, hr = randn((2, 3, 256), torch.bfloat16, gen), randn((2, 3, 256), torch.bfloat16, gen)
    torch.library.opcheck(ops.final_norm, (h, hr, w, EPS, None))
    torch.library.opcheck(ops.final_norm, (h, hr, w, EPS, torch.tensor([3, 1])))
    q, kv = randn((2, 3, 384), torch.bfloat16, gen), randn((2, 3, 320), torch.bfloat16, gen)
    torch.library.opcheck(ops.mla_latent_norms, (q, kv, randn((384,), torch.float32, gen), w, EPS))


def test_ops_under_a_dispatch_mode_match_the_direct_path():
    # Inside a dispatch mode the functional API goes through torch.ops: same results.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = gen_of(42)
    x, r, w = randn((2, 256), torch.bfloat16, gen), randn((2, 256), torch.bfloat16, gen), torch.ones(256)
    direct = fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0")
    with Count() as mode:
        via_op = fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0")
    assert any("fused_add_rms_norm_fp8" in c for c in mode.calls)
    assert fp8_equal(via_op[0], direct[0]) and torch.equal(via_op[1], direct[1])


def test_bench_cases_compare_equal_results():
    # The bench's fused, baseline (dsnorm's unfused calls) and reference (ref.py's eager formulas)
    # callables give the same outputs, bit for bit.
    for case in fusions.bench_cases(quick=True):
        fused, baseline, reference = case["fused"](), case["baseline"](), case["reference"]()
        assert len(fused) == len(baseline) == len(reference), case["name"]
        for ta, tb, tc in zip(fused, baseline, reference):
            if ta.dtype == torch.float8_e4m3fn:
                assert fp8_equal(ta, tb) and fp8_equal(ta, tc), case["name"]
            else:
                assert bits_equal(ta, tb) and bits_equal(ta, tc), case["name"]
        assert case["bytes"] > 0


def test_fusions_refuse_compatibility_options_by_name():
    import dsnorm

    x = torch.randn(2, 128).bfloat16()
    w = torch.ones(128)
    with pytest.raises(ValueError, match="cast='hf'"):
        dsnorm.rms_norm_fp8(x, w, cast="hf")
    with pytest.raises(ValueError, match="residual_rounding='round_first'"):
        dsnorm.fused_add_rms_norm_fp8(x, x.clone(), w, residual_rounding="round_first")
    with pytest.raises(ValueError, match="residual_dtype=torch.float32"):
        dsnorm.final_norm(x[None], x[None].clone(), w, residual_dtype=torch.float32)
    with pytest.raises(ValueError, match="cast='hf'"):
        dsnorm.mla_latent_norms(x, torch.randn(2, 40).bfloat16(), w, torch.ones(32), cast="hf")


# The dsnorm.cpu modules that define kernels (numba caches them).
KERNEL_MODULES = ("kernels", "fusion_kernels")


def _cpu_imports(module):
    """The dsnorm.cpu modules that ``dsnorm.cpu.<module>`` imports, directly or not (short names)."""
    found, todo = set(), [module]
    while todo:
        tree = ast.parse(Path(importlib.import_module(f"dsnorm.cpu.{todo.pop()}").__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dsnorm.cpu":
                names = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsnorm.cpu."):
                names = {node.module.split(".")[2]}
            else:
                continue
            todo += sorted(names - found)
            found |= names
    return found


def _dependencies_digest(module):
    """What ``DEPENDENCIES_SHA256`` of ``dsnorm.cpu.<module>`` must be: the sha256 of the sources of
    the modules it imports (in name order, each without its own ``DEPENDENCIES_SHA256`` line, so
    that one update serves a chain of them)."""
    digest = hashlib.sha256()
    for name in sorted(_cpu_imports(module)):
        text = Path(importlib.import_module(f"dsnorm.cpu.{name}").__file__).read_text()
        digest.update(name.encode() + b"\0")
        digest.update("".join(line for line in text.splitlines(keepends=True)
                              if not line.startswith("DEPENDENCIES_SHA256 = ")).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_caches_are_invalidated_with_the_modules_they_compile_in(module):
    # Found by review: after a change to cpu.py alone, a warm numba cache gave the fusion kernels
    # the old _forward_rows (mla_latent_norms no longer equal to rms_norm): numba stamps a cached
    # kernel with its own file only. A file of kernels must change with every module whose code its
    # kernels compile in, which this digest enforces (dsnorm.cpu.runtime).
    mod = importlib.import_module(f"dsnorm.cpu.{module}")
    digest = _dependencies_digest(module)
    assert mod.DEPENDENCIES_SHA256 == digest, (
        f"a module it imports ({', '.join(sorted(_cpu_imports(module)))}) changed: set dsnorm.cpu.{module}."
        f"DEPENDENCIES_SHA256 = {digest!r} so that numba recompiles its kernels (their cache is stamped "
        f"with {module}.py only)")
    assert "kernels" in _cpu_imports("fusion_kernels") and "cascade" in _cpu_imports(module)
    defining = {p.stem for p in Path(mod.__file__).parent.glob("*.py") if _kernel_definitions(p)}
    assert defining == set(KERNEL_MODULES)


def _kernel_calls_with_literals(path):
    """``(caller, callee, line)`` for each call from one ``@kernel`` function to another that
    passes a literal argument."""
    kernels = {name: node for name, (node, _) in _kernel_definitions(path).items()}
    names = set(kernels) | {"forward_rows"}  # fusion_kernels calls kernels' forward_rows
    found = []
    for caller, node in kernels.items():
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            callee = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
            if callee in names and any(isinstance(a, ast.Constant) for a in call.args):
                found.append((caller, callee, call.lineno))
    return found


@pytest.mark.parametrize("module", ["cpu.kernels", "cpu.fusion_kernels"])
def test_kernels_call_kernels_without_literal_arguments(module):
    # numba compiles a called kernel once per argument signature and types a literal 0 or False as
    # Literal[int](0) / Literal[bool](False): a serial caller passing 0 where the parallel one
    # passes a computed row compiled _forward_rows again (10 signatures of it in one suite run, 2
    # once the callers passed typed zeros; the first `dsnorm bench` 2m54s -> 2m02s from a cold cache).
    path = importlib.import_module(f"dsnorm.{module}").__file__
    assert _kernel_calls_with_literals(path) == []


def _kernel_definitions(path):
    """``{name: (FunctionDef, parallel)}`` for the ``@kernel(...)`` / ``@runtime.kernel(...)``
    functions of a source file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                name = getattr(d, "func", None) and (getattr(d.func, "id", None) or getattr(d.func, "attr", None))
                if isinstance(d, ast.Call) and name == "kernel":
                    parallel = any(k.arg == "parallel" and getattr(k.value, "value", None) is True for k in d.keywords)
                    found[node.name] = (node, parallel)
    return found


def _parallel_kernels_calling_kernels_by_name(paths):
    """``(parallel kernels, [(caller, callee, line)])``: each call from a ``parallel=True`` kernel
    to a kernel of any of ``paths`` by name or attribute (``_dweight_columns`` and
    ``thread_gain``, a few lines of code each, excepted: the cold compile of a threaded call is
    the same with or without thread_gain's)."""
    kernels = {}
    for path in paths:
        kernels.update(_kernel_definitions(path))
    names = set(kernels) - {"_dweight_columns", "thread_gain"}
    parallel = [node for node, is_parallel in kernels.values() if is_parallel]
    found = []
    for node in parallel:
        for call in ast.walk(node):
            if isinstance(call, ast.Call):
                callee = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
                if callee in names:
                    found.append((node.name, callee, call.lineno))
    return parallel, found


def test_parallel_kernels_call_their_rows_kernel_by_address():
    # Called by name, a kernel's machine code is linked into the parallel kernel's module and LLVM
    # optimises it again at each stage that builds a parallel kernel (the first prefill fused norm
    # compiled for 27 s on a 2-core Zen 3, 11 s by address); by address it is compiled once
    # (dsnorm.cpu.kernels).
    paths = [importlib.import_module(f"dsnorm.cpu.{m}").__file__ for m in KERNEL_MODULES]
    parallel, found = _parallel_kernels_calling_kernels_by_name(paths)
    assert len(parallel) == 5 and found == []


def test_a_call_by_address_checks_its_argument_types_and_propagates_errors():
    from numba import njit, prange, types
    from numba.core.errors import TypingError

    from dsnorm.cpu.intrinsics import by_address
    from dsnorm.cpu.launch import compiled_address

    @njit
    def divide(out, a, b):
        out[0] = a // b

    signature = (types.Array(types.int64, 1, "C"), types.int64, types.int64)
    call = by_address(signature)

    @njit
    def caller(address, out, a, b):
        call(address, (out, a, b))

    @njit
    def wrong_caller(address, out, a):
        call(address, (out, a, 1.5))  # a float where the compiled function takes an int64

    @njit(parallel=True)
    def parallel_caller(address, out, b):
        for t in prange(out.shape[0]):  # one call per row, on the pool's threads
            call(address, (out[t], np.int64(t) + 7, b))

    address = compiled_address(divide, signature)
    out = np.zeros(1, dtype=np.int64)
    caller(address, out, 7, 2)
    assert out[0] == 3
    with pytest.raises(ZeroDivisionError):  # the callee's exception reaches the caller's caller
        caller(address, out, 7, 0)
    with pytest.raises(TypingError, match="call by address with argument types"):
        wrong_caller(address, out, 7)
    rows = np.zeros((64, 1), dtype=np.int64)
    parallel_caller(address, rows, 2)
    assert rows[:, 0].tolist() == [(t + 7) // 2 for t in range(64)]


def test_calls_by_address_refuse_what_would_misread_memory():
    from numba import njit, types

    from dsnorm.cpu import kernels, launch
    from dsnorm.cpu.cascade import ACC_SLOTS
    from dsnorm.cpu.intrinsics import BF16, F32

    @njit
    def returns_a_value(a):
        return a + 1.0

    with pytest.raises(TypeError, match="returns float64; a call by address takes kernels that return None"):
        launch.compiled_address(returns_a_value, (types.float64,))
    # A launch whose scratch dtype is not its key's: the address would be the other compilation's.
    x = torch.randn(64, 1536, dtype=torch.bfloat16)
    scratch64 = launch.thread_rows(2, 1536 + ACC_SLOTS, np.float64)
    y = torch.empty_like(x)
    with pytest.raises(TypeError, match="a float64 scratch for key False, whose rows kernel takes float32"):
        launch.Parallel(kernels.forward_parallel, kernels.forward_rows, kernels.FORWARD_ROWS_SIGNATURES, 3).launch(
            False, 64, 1536, scratch64, x.data_ptr(), 1536, BF16, 0, 0, 0, torch.ones(1536).data_ptr(), F32,
            y.data_ptr(), 1536, 0, 0, 0, 0, 1e-6, False, False)
