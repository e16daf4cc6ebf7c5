"""Triton kernels and launchers of the inference fusions (the interface of ``dsnorm.cpu.launch``'s).

* ``rms_norm_fp8_kernel``: one program per row: the core's norm arithmetic (the helpers of
  :mod:`dsnorm.triton.kernels`: ``_load_s``, ``_rstd``, ``_row_sum``, ``_narrow``, ``_round_to``),
  then the quantisation of ``y`` rounded to x's dtype: the row is viewed as
  ``[BLOCK_N // QBLOCK, QBLOCK]``, ``amax`` is an integer max over the magnitudes' bit patterns
  (NaN-propagating, like ``torch.amax``), ``s = max(amax, 1e-4) * fp32(1/448)``, ue8m0 by bit
  arithmetic, ``q = e4m3fn(div_rn(y, s))`` with the conversion in integer arithmetic (exact in the
  interpreter and on the GPU alike; it saturates, which equals the reference's clamp). q is
  stored as uint8 bits.
* ``final_norm_kernel``: one program per batch row, at position ``lengths[b] - 1`` (without
  lengths the launcher runs the core kernel on the strided ``h[:, -1]`` rows instead).
* ``mla_latent_norms_kernel``: one launch, ``2 * rows`` programs: the first ``rows`` normalise
  q rows, the rest kv rows (each with its own width and block).

Kernels call only builtins of ``triton.language`` and jit helpers of this package (``tl.reduce``
with own combine functions), so they can be interpreted next to a compiled Triton (see
tests/test_fusions_triton.py). Helpers are reached as ``kernels.<name>`` so a reload of
``dsnorm.triton.kernels`` (interpreted or compiled) is seen.
"""

import numpy as np
import torch
import triton
import triton.language as tl

from dsnorm.triton import kernels, launch
from dsnorm.triton.launch import empty_output, forward  # noqa: F401 (the launcher interface)

# fp32 bit patterns (constexpr globals: the only globals a jit function may read).
AMAX_FLOOR_BITS = tl.constexpr(int(np.float32(1e-4).view(np.uint32)))  # max(amax, 1e-4)
INV_FP8_MAX_BITS = tl.constexpr(int(np.float32(1.0 / 448.0).view(np.uint32)))  # fp32(1/448)


# ---------------------------------------------------------------------------------------------
# Quantisation helpers.


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def e4m3_bits(v):
    """fp32 -> float8_e4m3fn bits (uint8): round to nearest even, saturating at +-448 (what the
    reference's clamp then cast gives), NaN -> 0x7F with the NaN's sign. See
    ``dsnorm.cpu.fusion_kernels._e4m3_bits`` for the derivation; this is the same integer
    arithmetic."""
    u = v.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0).to(tl.uint32)
    shift = tl.minimum(tl.maximum(141 - tl.maximum(e, 1).to(tl.int32), 21), 25).to(tl.uint32)
    k = m >> shift
    one = tl.full(a.shape, 1, tl.uint32)
    rem = m & ((one << shift) - 1)
    half = one << (shift - 1)
    up = (rem > half) | ((rem == half) & ((k & 1) == 1))
    k = k + up.to(tl.uint32)
    out = tl.where(a < 0x3C800000, k, normal)
    out = tl.where(a >= 0x43E00000, 0x7E, out)
    out = tl.where(a > 0x7F800000, 0x7F, out)
    return (out | sign).to(tl.uint8)


@triton.jit
def block_scales(yb, UE8M0: tl.constexpr):
    """Scales of the fp32 blocks ``yb`` ([NB, QBLOCK]) -> [NB] fp32."""
    mag = yb.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.maximum(tl.reduce(mag, 1, _max_combine), AMAX_FLOOR_BITS)
    inv = tl.full([], INV_FP8_MAX_BITS, tl.uint32).to(tl.float32, bitcast=True)
    s = amax.to(tl.float32, bitcast=True) * inv
    if UE8M0:
        sb = s.to(tl.uint32, bitcast=True)
        up = ((sb & 0x7FFFFF) != 0) & ((sb & 0x7F800000) != 0x7F800000)
        s = tl.where(up, (sb & 0x7F800000) + 0x800000, sb).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _quant_store(yr, Q_row, S_row, col0, n_cols, BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr,
                 UE8M0: tl.constexpr):
    """Quantise the fp32 chunk ``yr`` ([BLOCK_N], columns col0..) and store q bits and scales."""
    NB: tl.constexpr = BLOCK_N // QBLOCK
    yb = tl.reshape(yr, (NB, QBLOCK))
    s = block_scales(yb, UE8M0)
    q = e4m3_bits(tl.math.div_rn(yb, s[:, None]))
    cols = col0 + tl.arange(0, BLOCK_N)
    tl.store(Q_row + cols, tl.reshape(q, (BLOCK_N,)), mask=cols < n_cols)
    blocks = col0 // QBLOCK + tl.arange(0, NB)
    tl.store(S_row + blocks, s, mask=blocks < n_cols // QBLOCK)


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


@triton.jit
def rms_norm_fp8_kernel(
    X,  # [rows, n] bf16/fp16/fp32
    R,  # [rows, n] residual in x's dtype; any valid pointer unless HAS_RESIDUAL
    W,  # [n] fp32 weight
    Y,  # [rows, n] y in x's dtype; unused unless STORE_Y
    RO,  # [rows, n] residual_out in x's dtype; unused unless HAS_RESIDUAL
    Q,  # [rows, n] uint8: float8_e4m3fn bits, contiguous
    S,  # [rows, n // QBLOCK] fp32 scales, contiguous
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    n_rows,
    n_cols,
    eps: "fp64",
    BLOCK_N: tl.constexpr,  # power of two, a multiple of QBLOCK
    SINGLE_BLOCK: tl.constexpr,
    QBLOCK: tl.constexpr,  # columns per scale
    HAS_RESIDUAL: tl.constexpr,
    STORE_Y: tl.constexpr,
    UE8M0: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    XDT: tl.constexpr = X.dtype.element_ty
    CD: tl.constexpr = tl.float32
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    q_row = Q + row * n_cols
    s_row = S + row * (n_cols // QBLOCK)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        s = kernels._load_s(x_row + cols, r_row + cols, mask, HAS_RESIDUAL, False, XDT, CD)
        if HAS_RESIDUAL:
            tl.store(RO + row * stride_ro + cols, kernels._narrow(s, XDT), mask=mask)
        rstd = kernels._rstd(kernels._row_sum(s * s), n_cols, eps, CD)
        w = tl.load(W + cols, mask=mask, other=0.0)
        v = w * (s * rstd)
        if STORE_Y:
            tl.store(Y + row * stride_y + cols, kernels._narrow(v, XDT), mask=mask)
        _quant_store(kernels._round_to(v, XDT, CD), q_row, s_row, 0, n_cols, BLOCK_N, QBLOCK, UE8M0)
    else:
        rstd = kernels._blocked_rstd(x_row, r_row, cols, n_cols, eps, HAS_RESIDUAL, False, XDT, CD, BLOCK_N)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            m = c < n_cols
            s = kernels._load_s(x_row + c, r_row + c, m, HAS_RESIDUAL, False, XDT, CD)
            if HAS_RESIDUAL:
                tl.store(RO + row * stride_ro + c, kernels._narrow(s, XDT), mask=m)
            w = tl.load(W + c, mask=m, other=0.0)
            v = w * (s * rstd)
            if STORE_Y:
                tl.store(Y + row * stride_y + c, kernels._narrow(v, XDT), mask=m)
            _quant_store(kernels._round_to(v, XDT, CD), q_row, s_row, start, n_cols, BLOCK_N, QBLOCK, UE8M0)


def fp8_config(n: int, dtype: torch.dtype, qblock: int) -> tuple[int, int, bool]:
    """``(BLOCK_N, num_warps, single_block)``: the core's, with blocks at least one scale block."""
    block, warps, _ = launch.config(n, dtype)
    block = max(block, qblock)
    return block, warps, n <= block


def rms_norm_fp8_params(x, residual, weight, eps, ue8m0, qblock, y, residual_out, q, scales):
    rows, n = x.shape
    assert n % qblock == 0 and q.is_contiguous() and scales.is_contiguous()
    block, warps, single = fp8_config(n, x.dtype, qblock)
    args = (
        x, x if residual is None else residual, weight, x if y is None else y,
        x if residual_out is None else residual_out, q.view(torch.uint8), scales,
        x.stride(0), 0 if residual is None else residual.stride(0), 0 if y is None else y.stride(0),
        0 if residual_out is None else residual_out.stride(0), rows, n, float(eps),
    )
    meta = dict(BLOCK_N=block, SINGLE_BLOCK=single, QBLOCK=qblock, HAS_RESIDUAL=residual is not None,
                STORE_Y=y is not None, UE8M0=bool(ue8m0), num_warps=warps, **launch.FWD_OPTIONS)
    return (rows,), args, meta


def _rows(t):
    return t if t is None or t.dim() == 2 else t.view(-1, t.shape[-1])


def rms_norm_fp8(x, residual, weight, eps, ue8m0, block, y, residual_out, q, scales) -> None:
    """q, scales = act_quant(y); y = norm(x (+ residual)); residual_out = x + residual (see
    ``dsnorm.cpu.launch.rms_norm_fp8`` for the contract)."""
    if x.numel() == 0:
        return
    grid, args, meta = rms_norm_fp8_params(_rows(x), _rows(residual), weight, eps, ue8m0, block, _rows(y),
                                           _rows(residual_out), _rows(q), _rows(scales))
    with launch.on_device(x):
        rms_norm_fp8_kernel[grid](*args, **meta)


# ---------------------------------------------------------------------------------------------
# One row of the plain or fused norm (DeepSeek cast, fp32_sum), for the two kernels below.


@triton.jit
def _norm_row(x_row, r_row, w_ptr, y_row, ro_row, n_cols, eps, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, CD: tl.constexpr):
    XDT: tl.constexpr = x_row.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        s = kernels._load_s(x_row + cols, r_row + cols, mask, HAS_RESIDUAL, False, XDT, CD)
        if HAS_RESIDUAL:
            tl.store(ro_row + cols, kernels._narrow(s, XDT), mask=mask)
        rstd = kernels._rstd(kernels._row_sum(s * s), n_cols, eps, CD)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(CD)
        tl.store(y_row + cols, kernels._scale(s * rstd, w, XDT, False, CD), mask=mask)
    else:
        rstd = kernels._blocked_rstd(x_row, r_row, cols, n_cols, eps, HAS_RESIDUAL, False, XDT, CD, BLOCK_N)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            m = c < n_cols
            s = kernels._load_s(x_row + c, r_row + c, m, HAS_RESIDUAL, False, XDT, CD)
            if HAS_RESIDUAL:
                tl.store(ro_row + c, kernels._narrow(s, XDT), mask=m)
            w = tl.load(w_ptr + c, mask=m, other=0.0).to(CD)
            tl.store(y_row + c, kernels._scale(s * rstd, w, XDT, False, CD), mask=m)


# ---------------------------------------------------------------------------------------------
# Final norm at each row's last valid position.


@triton.jit
def final_norm_kernel(
    H,  # [B, T, n], unit stride along n
    R,  # [B, T, n] residual, h's dtype
    LENGTHS,  # [B] int64, values in [1, T] (checked by the op)
    W,  # [n] weight in the compute dtype
    Y,  # [B, n] contiguous
    RO,  # [B, n] contiguous
    stride_hb, stride_ht, stride_rb, stride_rt,
    n_cols,
    eps: "fp64",
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    CD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(LENGTHS + b) - 1
    _norm_row(H + b * stride_hb + pos * stride_ht, R + b * stride_rb + pos * stride_rt, W, Y + b * n_cols,
              RO + b * n_cols, n_cols, eps, BLOCK_N, SINGLE_BLOCK, True, CD)


def final_norm_params(h, residual, weight, eps, lengths, y, residual_out):
    batch, _, n = h.shape
    # Unit stride along the row (a width-1 row has none to speak of: only column 0 is read).
    assert (n == 1 or (h.stride(2) == 1 and residual.stride(2) == 1)) and lengths.dtype == torch.int64
    block, warps, single = launch.config(n, h.dtype)
    args = (h, residual, lengths, weight, y, residual_out, h.stride(0), h.stride(1), residual.stride(0),
            residual.stride(1), n, float(eps))
    meta = dict(BLOCK_N=block, SINGLE_BLOCK=single, CD=launch._compute_dtype(h.dtype), num_warps=warps,
                **launch.FWD_OPTIONS)
    return (batch,), args, meta


def final_norm_lengths(h, residual, weight, eps, lengths, y, residual_out) -> None:
    """Row b of y / residual_out = the fused norm of ``h[b, lengths[b] - 1]`` (+ residual's)."""
    if h.shape[0] == 0:
        return
    grid, args, meta = final_norm_params(h, residual, weight, eps, lengths, y, residual_out)
    with launch.on_device(h):
        final_norm_kernel[grid](*args, **meta)


# ---------------------------------------------------------------------------------------------
# MLA latents in one launch.


@triton.jit
def mla_latent_norms_kernel(
    XQ,  # [rows, nq]
    XKV,  # [rows, nkv] (a slice of wider rows, read in place)
    WQ, WKV,  # weights in the compute dtype
    YQ, YKV,  # contiguous outputs
    stride_q, stride_kv,
    n_rows, nq, nkv,
    eps: "fp64",
    BLOCK_Q: tl.constexpr, SINGLE_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr, SINGLE_KV: tl.constexpr,
    CD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_rows:
        _norm_row(XQ + pid * stride_q, XQ, WQ, YQ + pid * nq, YQ, nq, eps, BLOCK_Q, SINGLE_Q, False, CD)
    else:
        row = pid - n_rows
        _norm_row(XKV + row * stride_kv, XKV, WKV, YKV + row * nkv, YKV, nkv, eps, BLOCK_KV, SINGLE_KV, False, CD)


def mla_params(q_latent, kv, q_weight, kv_weight, eps, q_out, kv_out):
    rows, nq = q_latent.shape
    nkv = kv.shape[1]
    bq, wq, sq = launch.config(nq, q_latent.dtype)
    bkv, wkv, skv = launch.config(nkv, kv.dtype)
    args = (q_latent, kv, q_weight, kv_weight, q_out, kv_out, q_latent.stride(0), kv.stride(0), rows, nq, nkv,
            float(eps))
    meta = dict(BLOCK_Q=bq, SINGLE_Q=sq, BLOCK_KV=bkv, SINGLE_KV=skv, CD=launch._compute_dtype(q_latent.dtype),
                num_warps=max(wq, wkv), **launch.FWD_OPTIONS)
    return (2 * rows,), args, meta


def mla_latent_norms(q_latent, kv_a, q_weight, kv_weight, eps, q_out, kv_out) -> None:
    """q_out = norm(q_latent), kv_out = norm(kv_a[..., :nkv]), one launch (contract of
    ``dsnorm.cpu.launch``'s): the slice is a strided view, read in place."""
    if q_latent.numel() == 0:
        return
    kv = kv_a[..., : kv_weight.shape[0]]
    grid, args, meta = mla_params(_rows(q_latent), _rows(kv), q_weight, kv_weight, eps, _rows(q_out), _rows(kv_out))
    with launch.on_device(q_latent):
        mla_latent_norms_kernel[grid](*args, **meta)
