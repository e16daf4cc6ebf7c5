"""The kernels of the inference fusions: norm + fp8 block quantisation, the final norm on the last
valid position, and the two MLA latent norms in one launch.

Every norm here *is* the core's: each kernel calls :func:`dsnorm.cpu.kernels.forward_rows` (load /
add, the torch-order sum, ``rstd``, the scaled value rounded once to ``x.dtype``), so ``y`` and
``residual_out`` are bitwise those of ``dsnorm.rms_norm`` / ``dsnorm.fused_add_rms_norm``. What is
new is only around it:

* fp8: each row's ``y`` is written (to the output, or to a per-thread scratch row in ``x.dtype``),
  read back widened to fp32 (so the quantisation sees exactly ``y.float()``), and quantised in
  blocks: ``amax`` as an integer max over the magnitudes' bit patterns (for non-negative floats the
  integer order is the float order, and a NaN's pattern is above inf's, so a NaN propagates like
  ``torch.amax``), ``max(amax, 1e-4)``, ``s = amax * fp32(1/448)``, ``2^ceil(log2 s)`` by bit
  arithmetic for ue8m0, ``q = e4m3fn(y / s)`` with the conversion written in integer arithmetic
  (:func:`_e4m3_bits`).
* final norm with ``lengths``: each row's addresses are computed from its length; no gather copy.
* MLA: one kernel whose threads run both norms over their block of rows.

Tensors arrive as addresses and element strides, and parallel kernels call their rows kernel by
address, as in :mod:`dsnorm.cpu.kernels`.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from dsnorm.cpu.intrinsics import by_address, f32_as_u32, pointer_intrinsic, ptr_f32, u32_as_f32
from dsnorm.cpu.kernels import I0, I64, NO, ROW, compute_code, forward_rows
from dsnorm.cpu.runtime import kernel, run
from dsnorm.cpu.stages import load_row

# This module's kernels compile those of the modules above into themselves: the digest of their
# sources (see dsnorm.cpu.runtime) makes a change to any of them a change to this file.
DEPENDENCIES_SHA256 = '2b54fa5df3a55f6bc252eb7205e37a22f872b7d01252f87ad3dda1c952447183'

_ptr_u8 = pointer_intrinsic(types.uint8, ir.IntType(8))
_ptr_i64 = pointer_intrinsic(types.int64, ir.IntType(64))

# fp32 bit patterns of the quantisation constants.
AMAX_FLOOR_BITS = int(np.float32(1e-4).view(np.uint32))  # max(amax, 1e-4), 1e-4 rounded to fp32
INV_FP8_MAX_BITS = int(np.float32(1.0 / 448.0).view(np.uint32))  # fp32(1/448) = 0x3B124925
FP8_MAX_BITS = int(np.float32(448.0).view(np.uint32))  # 0x43E00000
F32_MIN_NORMAL_E4M3_BITS = int(np.float32(2.0**-6).view(np.uint32))  # e4m3fn's smallest normal


# ---------------------------------------------------------------------------------------------
# fp32 -> float8_e4m3fn, and the ue8m0 scale.


_U = numba.uint32


@intrinsic
def _e4m3_bits(typingctx, v):
    """fp32 ``v`` -> float8_e4m3fn bits (uint8), round to nearest even, saturating.

    Saturation: a magnitude at or above 448 (e4m3fn's largest finite) gives +-448, which is what
    ``clamp(v, -448, 448).to(float8_e4m3fn)`` gives (also for inf); so the kernels skip the clamp.
    NaN -> 0x7F with the NaN's sign bit (0xFF for a negative NaN), as torch converts it.

    With ``a = |v|``'s bits: normal results (``a >= 2^-6``) keep the top 3 mantissa bits and round
    the 20 dropped ones to nearest even by the carry trick (add 0x7FFFF plus the lowest kept bit; a
    carry out of the mantissa bumps the exponent), then rebias the exponent from 127 to 7
    (``- 120 << 3``). Subnormal results are ``k * 2^-9``, ``k`` the integer nearest to
    ``|v| * 2^9`` (ties to even): the significand ``m`` (implicit bit included) shifted right by
    ``141 - e`` (``e`` the exponent field), rounding on the shifted-out remainder against its half;
    ``e`` is clamped to 116..120 (below 116, ``|v| < 2^-10`` and k is 0 either way).

    Written as LLVM IR on i32 lanes: numba would widen the same arithmetic written in Python to
    64-bit integers, which vectorises at half the width and ran several times slower.
    """
    i32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        def c(x):
            return ir.Constant(i32, x)

        def umin(x, y):
            return builder.select(builder.icmp_unsigned("<", x, y), x, y)

        def umax(x, y):
            return builder.select(builder.icmp_unsigned(">", x, y), x, y)

        u = builder.bitcast(args[0], i32)
        sign = builder.and_(builder.lshr(u, c(24)), c(0x80))
        a = builder.and_(u, c(0x7FFFFFFF))
        odd = builder.and_(builder.lshr(a, c(20)), c(1))
        normal = builder.sub(builder.lshr(builder.add(builder.add(a, c(0x7FFFF)), odd), c(20)), c(120 << 3))
        e = builder.lshr(a, c(23))
        implicit = builder.select(builder.icmp_unsigned("!=", e, c(0)), c(0x800000), c(0))
        m = builder.or_(builder.and_(a, c(0x7FFFFF)), implicit)
        shift = builder.sub(c(141), umin(umax(e, c(116)), c(120)))
        k = builder.lshr(m, shift)
        rem = builder.and_(m, builder.sub(builder.shl(c(1), shift), c(1)))
        half = builder.shl(c(1), builder.sub(shift, c(1)))
        tie_odd = builder.and_(builder.icmp_unsigned("==", rem, half),
                               builder.icmp_unsigned("!=", builder.and_(k, c(1)), c(0)))
        up = builder.or_(builder.icmp_unsigned(">", rem, half), tie_odd)
        k = builder.add(k, builder.zext(up, i32))
        out = builder.select(builder.icmp_unsigned("<", a, c(F32_MIN_NORMAL_E4M3_BITS)), k, normal)
        out = builder.select(builder.icmp_unsigned(">=", a, c(FP8_MAX_BITS)), c(0x7E), out)
        out = builder.select(builder.icmp_unsigned(">", a, c(0x7F800000)), c(0x7F), out)
        return builder.trunc(builder.or_(out, sign), ir.IntType(8))

    return types.uint8(types.float32), codegen


@njit(inline="always")
def _ue8m0(s):
    """The smallest power of two >= the positive fp32 ``s`` (inf and NaN unchanged): a mantissa of
    zero is already a power of two; otherwise clear it and add one to the exponent."""
    bits = f32_as_u32(s)
    if (bits & _U(0x7FFFFF)) != _U(0) and (bits & _U(0x7F800000)) != _U(0x7F800000):
        bits = (bits & _U(0x7F800000)) + _U(0x800000)
    return u32_as_f32(bits)


@njit(inline="always")
def _quant_blocks(buf, n, block, ue8m0, q, q_off, sp, s_off):
    inv = u32_as_f32(_U(INV_FP8_MAX_BITS))
    for b in range(n // block):
        base = b * block
        m = _U(AMAX_FLOOR_BITS)  # the floor first: max is order-free on integers
        for j in range(base, base + block):
            m = max(m, f32_as_u32(buf[j]) & _U(0x7FFFFFFF))
        s = u32_as_f32(m) * inv
        if ue8m0:
            s = _ue8m0(s)
            # y * (1/s) is y / s exactly: both round the same exact product y * 2^-k once (1/s is
            # a power of two, representable for every s >= 1e-4/448, subnormal 2^-127 included).
            r = u32_as_f32(_U(0x3F800000)) / s
            for j in range(base, base + block):
                q[q_off + j] = _e4m3_bits(buf[j] * r)
        else:
            for j in range(base, base + block):
                q[q_off + j] = _e4m3_bits(buf[j] / s)
        sp[s_off + b] = s


@njit(inline="always")
def _quant_row(buf, n, block, ue8m0, q_addr, q_off, s_addr, s_off):
    """Quantise the fp32 row ``buf[:n]`` in blocks of ``block``: scales to ``s_addr`` (fp32),
    e4m3fn bits to ``q_addr`` (uint8)."""
    q = _ptr_u8(q_addr)
    sp = ptr_f32(s_addr)
    if block == 128:  # DeepSeek's: constant trip counts vectorise better
        _quant_blocks(buf, n, 128, ue8m0, q, q_off, sp, s_off)
    else:
        _quant_blocks(buf, n, block, ue8m0, q, q_off, sp, s_off)


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


@kernel()
def fp8_rows(
    r0, r1, n, scratch, ytmp_addr,
    x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
):
    nblocks = n // block
    for row in range(r0, r1):
        if y_addr != 0:
            ya, ys = y_addr, y_stride
        else:
            ya, ys = ytmp_addr, 0  # this thread's scratch row, rewritten for every row
        forward_rows(
            row, row + 1, n, scratch,
            x_addr, x_stride, x_code, res_addr, res_stride, x_code, w_addr, compute_code(scratch), ya, ys,
            rout_addr, rout_stride, x_code, I0, eps, NO, NO,
        )
        buf = scratch[:n]
        load_row(ya, row * ys, x_code, buf, n, False)  # y.float(): exact widening of the stored y
        _quant_row(buf, n, block, ue8m0, q_addr, row * n, s_addr, row * nblocks)


@kernel()
def fp8_serial(
    rows, n, scratch, ytmp_addr, ytmp_bytes,
    x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
):
    fp8_rows(
        I0, rows, n, scratch[0], ytmp_addr,
        x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
        rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
    )


# fp8_rows' argument types (fp32 compute only), for the call by address (by_address).
FP8_ROWS_SIGNATURES = {
    None: (I64,) * 3 + (ROW[False],) + (I64,) * 11 + (types.float64, I64, types.boolean, I64, I64),
}
_call_fp8_rows = by_address(*FP8_ROWS_SIGNATURES.values())


@kernel(parallel=True)
def fp8_parallel(
    rows_kernel, rows, n, scratch, ytmp_addr, ytmp_bytes,
    x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
):
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_fp8_rows(rows_kernel, (
            rows * t // nthreads, rows * (t + 1) // nthreads, n, scratch[t], ytmp_addr + t * ytmp_bytes,
            x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
            rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
        ))


# ---------------------------------------------------------------------------------------------
# Final norm at each row's last valid position.


@kernel()
def final_rows(
    b0, b1, n, scratch, len_addr, esize,
    h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    lengths = _ptr_i64(len_addr)
    for b in range(b0, b1):
        pos = lengths[b] - 1
        forward_rows(
            I0, I0 + 1, n, scratch,
            h_addr + (b * h_sb + pos * h_st) * esize, I0, code,
            r_addr + (b * r_sb + pos * r_st) * esize, I0, code,
            w_addr, compute_code(scratch), y_addr + b * n * esize, I0, ro_addr + b * n * esize, I0, code,
            I0, eps, NO, NO,
        )


@kernel()
def final_serial(
    rows, n, scratch, len_addr, esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    final_rows(I0, rows, n, scratch[0], len_addr, esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr,
               y_addr, ro_addr, eps)


# final_rows' argument types by compute dtype (x64), for the call by address (by_address).
FINAL_ROWS_SIGNATURES = {x64: (I64,) * 3 + (ROW[x64],) + (I64,) * 12 + (types.float64,) for x64 in (False, True)}
_call_final_rows = by_address(*FINAL_ROWS_SIGNATURES.values())


@kernel(parallel=True)
def final_parallel(
    rows_kernel, rows, n, scratch, len_addr, esize,
    h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_final_rows(rows_kernel, (rows * t // nthreads, rows * (t + 1) // nthreads, n, scratch[t], len_addr,
                                       esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr,
                                       eps))


# ---------------------------------------------------------------------------------------------
# MLA latents: q_norm and kv_norm in one kernel.


@kernel()
def mla_rows(
    r0, r1, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr,
    nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    forward_rows(r0, r1, nq, scratch, q_addr, q_stride, code, I0, I0, code, wq_addr, compute_code(scratch), yq_addr, nq,
                 I0, I0, code, I0, eps, NO, NO)
    forward_rows(r0, r1, nkv, scratch, kv_addr, kv_stride, code, I0, I0, code, wkv_addr, compute_code(scratch), ykv_addr, nkv,
                 I0, I0, code, I0, eps, NO, NO)


@kernel()
def mla_serial(
    rows, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    mla_rows(I0, rows, scratch[0], code, eps, nq, q_addr, q_stride, wq_addr, yq_addr,
             nkv, kv_addr, kv_stride, wkv_addr, ykv_addr)


# mla_rows' argument types by compute dtype (x64), for the call by address (by_address).
MLA_ROWS_SIGNATURES = {x64: (I64,) * 2 + (ROW[x64], I64, types.float64) + (I64,) * 10 for x64 in (False, True)}
_call_mla_rows = by_address(*MLA_ROWS_SIGNATURES.values())


@kernel(parallel=True)
def mla_parallel(
    rows_kernel, rows, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_mla_rows(rows_kernel, (rows * t // nthreads, rows * (t + 1) // nthreads, scratch[t], code, eps,
                                     nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr,
                                     ykv_addr))


# ---------------------------------------------------------------------------------------------
# The conversions over arrays, for tests.


def e4m3_bits(values: np.ndarray) -> np.ndarray:
    """The kernels' fp32 -> float8_e4m3fn conversion over a float32 array (uint8 bits): for tests."""
    out = np.empty(values.shape, dtype=np.uint8)
    run(_e4m3_array, None, values.reshape(-1), out.reshape(-1))
    return out


def ue8m0_scales(values: np.ndarray) -> np.ndarray:
    """The kernels' ``2^ceil(log2 s)`` over a float32 array: for tests."""
    out = np.empty(values.shape, dtype=np.float32)
    run(_ue8m0_array, None, values.reshape(-1), out.reshape(-1))
    return out


@kernel()
def _e4m3_array(values, out):
    for i in range(values.shape[0]):
        out[i] = _e4m3_bits(values[i])


@kernel()
def _ue8m0_array(values, out):
    for i in range(values.shape[0]):
        out[i] = _ue8m0(values[i])
