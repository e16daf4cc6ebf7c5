"""CPU kernels (numba) of the inference fusions: norm + fp8 block quantisation, the final norm on
the last valid position, and the two MLA latent norms in one launch.

Every norm here *is* the core's: each kernel calls :func:`dsnorm.cpu._forward_rows` (load / add,
the torch-order sum (``_sum_step`` / ``_sum_finish``), ``rstd``, the scaled value rounded once to ``x.dtype``), so ``y`` and
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

Tensors arrive as addresses and element strides, as in :mod:`dsnorm.cpu`.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from dsnorm import cpu
from dsnorm.dispatch import PLAIN_TYPES as _PLAIN_TYPES
from dsnorm.cpu import (
    _kernel,
    _EPS_MAX,
    _EPS_MIN,
    _F32,
    _STRIDED,
    ACC_SLOTS,
    DTYPE_CODES,
    SERIAL_NUMEL,
    _I0,
    _I64,
    _NO,
    _ROW,
    Parallel,
    _by_address,
    _f32_as_u32,
    _load_row,
    _pointer_intrinsic,
    _ptr_f32,
    _run,
    _scratch,
    thread_rows,
    _threads,
    _u32_as_f32,
    empty_output,
    forward,
    row_stride,
)

__all__ = ["empty_output", "forward", "rms_norm_fp8", "final_norm_lengths", "mla_latent_norms"]

# numba stamps a cached kernel with the file that defines it (its time and size), but these kernels
# compile cpu.py's row functions into themselves: a numba cache kept across a change to cpu.py alone
# (a persistent NUMBA_CACHE_DIR beside a checkout) ran the old code here. So every change to cpu.py
# changes this file too: this digest of cpu.py is checked by tests/test_fusions.py.
CPU_SOURCE_SHA256 = "6f6e5681bf48d878366d394f8dbf9b0b53c8c08419f4a1b973b42f35928dd79d"

_ptr_u8 = _pointer_intrinsic(types.uint8, ir.IntType(8))
_ptr_i64 = _pointer_intrinsic(types.int64, ir.IntType(64))

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
    64-bit integers, which vectorises at half the width and ran ~3x slower.
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
    bits = _f32_as_u32(s)
    if (bits & _U(0x7FFFFF)) != _U(0) and (bits & _U(0x7F800000)) != _U(0x7F800000):
        bits = (bits & _U(0x7F800000)) + _U(0x800000)
    return _u32_as_f32(bits)


@njit(inline="always")
def _quant_blocks(buf, n, block, ue8m0, q, q_off, sp, s_off):
    inv = _u32_as_f32(_U(INV_FP8_MAX_BITS))
    for b in range(n // block):
        base = b * block
        m = _U(AMAX_FLOOR_BITS)  # the floor first: max is order-free on integers
        for j in range(base, base + block):
            m = max(m, _f32_as_u32(buf[j]) & _U(0x7FFFFFFF))
        s = _u32_as_f32(m) * inv
        if ue8m0:
            s = _ue8m0(s)
            # y * (1/s) is y / s exactly: both round the same exact product y * 2^-k once (1/s is
            # a power of two, representable for every s >= 1e-4/448, subnormal 2^-127 included).
            r = _u32_as_f32(_U(0x3F800000)) / s
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
    sp = _ptr_f32(s_addr)
    if block == 128:  # DeepSeek's: constant trip counts vectorise better (~2.5x)
        _quant_blocks(buf, n, 128, ue8m0, q, q_off, sp, s_off)
    else:
        _quant_blocks(buf, n, block, ue8m0, q, q_off, sp, s_off)


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


@_kernel()
def _fp8_rows(
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
        cpu._forward_rows(
            row, row + 1, n, scratch,
            x_addr, x_stride, x_code, res_addr, res_stride, x_code, w_addr, ya, ys,
            rout_addr, rout_stride, x_code, _I0, eps, _NO, _NO,
        )
        buf = scratch[:n]
        _load_row(ya, row * ys, x_code, buf, n, False)  # y.float(): exact widening of the stored y
        _quant_row(buf, n, block, ue8m0, q_addr, row * n, s_addr, row * nblocks)


@_kernel()
def _fp8_serial(
    rows, n, scratch, ytmp_addr, ytmp_bytes,
    x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
):
    _fp8_rows(
        _I0, rows, n, scratch[0], ytmp_addr,
        x_addr, x_stride, x_code, res_addr, res_stride, w_addr, y_addr, y_stride,
        rout_addr, rout_stride, eps, block, ue8m0, q_addr, s_addr,
    )


# _fp8_rows' argument types (fp32 compute only), for the call by address (cpu._by_address).
FP8_ROWS_SIGNATURES = {
    None: (_I64,) * 3 + (_ROW[False],) + (_I64,) * 11 + (types.float64, _I64, types.boolean, _I64, _I64),
}
_call_fp8_rows = _by_address(*FP8_ROWS_SIGNATURES.values())


@_kernel(parallel=True)
def _fp8_parallel(
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


_FP8_PARALLEL = Parallel(_fp8_parallel, _fp8_rows, FP8_ROWS_SIGNATURES, 3)
_local = threading.local()


def _row_scratch(nthreads: int, nbytes: int) -> np.ndarray:
    """Per-thread rows of ``nbytes`` (the y rows nobody asked for), cached per calling thread."""
    cache = getattr(_local, "rows", None)
    # Rebuilt when a row would eat into the page that keeps the threads' rows apart.
    if cache is None or cache.shape[0] < nthreads or cache.shape[1] - nbytes < 4096:
        cache = thread_rows(nthreads, max(nbytes, 64), np.uint8)
        _local.rows = cache
    return cache


def rms_norm_fp8(x, residual, weight, eps, ue8m0, block, y, residual_out, q, scales) -> None:
    """q, scales = act_quant(y); y = norm(x (+ residual)); residual_out = x + residual.

    x: ``[..., n]`` bf16/fp16/fp32 rows (unit stride, one row stride); residual / residual_out:
    the same, x's dtype, or None; weight: [n] fp32; y: contiguous output in x's dtype or None (then
    y lives in per-thread scratch only); q: contiguous ``[..., n]`` float8_e4m3fn; scales:
    contiguous ``[..., n // block]`` fp32. ``n % block == 0`` (checked by the op).
    """
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return
    rows = numel // n
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(_threads(numel), rows))
    scratch = _scratch(nthreads, n + ACC_SLOTS, np.float32)
    row_bytes = -(-n * x.element_size() // 64) * 64  # whole cache lines
    ytmp = _row_scratch(nthreads, row_bytes)
    cpu.run_either(
        nthreads, _fp8_serial, _FP8_PARALLEL, None,
        rows, n, scratch, ytmp.ctypes.data, ytmp.shape[1],
        x.data_ptr(), row_stride(x), DTYPE_CODES[x.dtype],
        0 if residual is None else residual.data_ptr(), 0 if residual is None else row_stride(residual),
        weight.data_ptr(), 0 if y is None else y.data_ptr(), 0 if y is None else n,
        0 if residual_out is None else residual_out.data_ptr(), 0 if residual_out is None else n,
        float(eps), int(block), bool(ue8m0), q.data_ptr(), scales.data_ptr(),
    )


# ---------------------------------------------------------------------------------------------
# Final norm at each row's last valid position.


@_kernel()
def _final_rows(
    b0, b1, n, scratch, len_addr, esize,
    h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    lengths = _ptr_i64(len_addr)
    for b in range(b0, b1):
        pos = lengths[b] - 1
        cpu._forward_rows(
            _I0, _I0 + 1, n, scratch,
            h_addr + (b * h_sb + pos * h_st) * esize, _I0, code,
            r_addr + (b * r_sb + pos * r_st) * esize, _I0, code,
            w_addr, y_addr + b * n * esize, _I0, ro_addr + b * n * esize, _I0, code,
            _I0, eps, _NO, _NO,
        )


@_kernel()
def _final_serial(
    rows, n, scratch, len_addr, esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    _final_rows(_I0, rows, n, scratch[0], len_addr, esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr,
                y_addr, ro_addr, eps)


# _final_rows' argument types by compute dtype (x64), for the call by address (cpu._by_address).
FINAL_ROWS_SIGNATURES = {x64: (_I64,) * 3 + (_ROW[x64],) + (_I64,) * 12 + (types.float64,) for x64 in (False, True)}
_call_final_rows = _by_address(*FINAL_ROWS_SIGNATURES.values())


@_kernel(parallel=True)
def _final_parallel(
    rows_kernel, rows, n, scratch, len_addr, esize,
    h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr, eps,
):
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_final_rows(rows_kernel, (rows * t // nthreads, rows * (t + 1) // nthreads, n, scratch[t], len_addr,
                                       esize, h_addr, h_sb, h_st, code, r_addr, r_sb, r_st, w_addr, y_addr, ro_addr,
                                       eps))


_FINAL_PARALLEL = Parallel(_final_parallel, _final_rows, FINAL_ROWS_SIGNATURES, 3)


def final_norm_lengths(h, residual, weight, eps, lengths, y, residual_out) -> None:
    """Row b of y / residual_out = the fused norm of ``h[b, lengths[b] - 1]`` (+ residual's).

    h, residual: ``[B, T, n]`` with unit stride along n (any B and T strides); lengths: ``[B]``
    contiguous int64 with values in ``[1, T]`` (checked by the op); weight: [n] fp32;
    y, residual_out: contiguous ``[B, n]`` in h's dtype.
    """
    rows, _, n = h.shape
    if rows == 0:
        return
    numel = rows * n
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(_threads(numel), rows))
    scratch = _scratch(nthreads, n + ACC_SLOTS, np.float64 if h.dtype == torch.float64 else np.float32)
    cpu.run_either(
        nthreads, _final_serial, _FINAL_PARALLEL, h.dtype == torch.float64,
        rows, n, scratch, lengths.data_ptr(), h.element_size(),
        h.data_ptr(), h.stride(0), h.stride(1), DTYPE_CODES[h.dtype],
        residual.data_ptr(), residual.stride(0), residual.stride(1),
        weight.data_ptr(), y.data_ptr(), residual_out.data_ptr(), float(eps),
    )


# ---------------------------------------------------------------------------------------------
# MLA latents: q_norm and kv_norm in one kernel.


@_kernel()
def _mla_rows(
    r0, r1, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr,
    nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    cpu._forward_rows(r0, r1, nq, scratch, q_addr, q_stride, code, _I0, _I0, code, wq_addr, yq_addr, nq,
                      _I0, _I0, code, _I0, eps, _NO, _NO)
    cpu._forward_rows(r0, r1, nkv, scratch, kv_addr, kv_stride, code, _I0, _I0, code, wkv_addr, ykv_addr, nkv,
                      _I0, _I0, code, _I0, eps, _NO, _NO)


@_kernel()
def _mla_serial(
    rows, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    _mla_rows(_I0, rows, scratch[0], code, eps, nq, q_addr, q_stride, wq_addr, yq_addr,
              nkv, kv_addr, kv_stride, wkv_addr, ykv_addr)


# _mla_rows' argument types by compute dtype (x64), for the call by address (cpu._by_address).
MLA_ROWS_SIGNATURES = {x64: (_I64,) * 2 + (_ROW[x64], _I64, types.float64) + (_I64,) * 10 for x64 in (False, True)}
_call_mla_rows = _by_address(*MLA_ROWS_SIGNATURES.values())


@_kernel(parallel=True)
def _mla_parallel(
    rows_kernel, rows, scratch, code, eps,
    nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr, ykv_addr,
):
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_mla_rows(rows_kernel, (rows * t // nthreads, rows * (t + 1) // nthreads, scratch[t], code, eps,
                                     nq, q_addr, q_stride, wq_addr, yq_addr, nkv, kv_addr, kv_stride, wkv_addr,
                                     ykv_addr))


_MLA_PARALLEL = Parallel(_mla_parallel, _mla_rows, MLA_ROWS_SIGNATURES, 2)


def mla_latent_norms(q_latent, kv_a, q_weight, kv_weight, eps, q_out, kv_out) -> None:
    """q_out = norm(q_latent), kv_out = norm(kv_a[..., :nkv]) in one kernel call, nkv = kv_weight's width.

    q_latent: ``[..., nq]``; kv_a: ``[..., >= nkv]`` with the same leading shape (576 wide in
    DeepSeek: its first 512 columns are read in place, no slice is even built); both unit stride
    along the row with one row stride, one dtype; weights fp32 (fp64 for fp64 inputs); q_out,
    kv_out: contiguous ``[..., nq]`` / ``[..., nkv]`` outputs.
    """
    nq, nkv, kv = q_latent.shape[-1], kv_weight.shape[0], kv_a
    rows = q_latent.numel() // nq if nq else 0
    if rows == 0:
        return
    # Threads as for the wider of the two separate calls: never parallel where both would be serial.
    numel = rows * max(nq, nkv)
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(_threads(numel), rows))
    x64 = q_latent.dtype == torch.float64
    scratch = _scratch(nthreads, max(nq, nkv) + ACC_SLOTS, np.float64 if x64 else np.float32)
    cpu.run_either(
        nthreads, _mla_serial, _MLA_PARALLEL, x64,
        rows, scratch, DTYPE_CODES[q_latent.dtype], float(eps),
        nq, q_latent.data_ptr(), row_stride(q_latent), q_weight.data_ptr(), q_out.data_ptr(),
        nkv, kv.data_ptr(), row_stride(kv), kv_weight.data_ptr(), kv_out.data_ptr(),
    )


def e4m3_bits(values: np.ndarray) -> np.ndarray:
    """The kernels' fp32 -> float8_e4m3fn conversion over a float32 array (uint8 bits): for tests."""
    out = np.empty(values.shape, dtype=np.uint8)
    _run(_e4m3_array, None, values.reshape(-1), out.reshape(-1))
    return out


def ue8m0_scales(values: np.ndarray) -> np.ndarray:
    """The kernels' ``2^ceil(log2 s)`` over a float32 array: for tests."""
    out = np.empty(values.shape, dtype=np.float32)
    _run(_ue8m0_array, None, values.reshape(-1), out.reshape(-1))
    return out


@_kernel()
def _e4m3_array(values, out):
    for i in range(values.shape[0]):
        out[i] = _e4m3_bits(values[i])


@_kernel()
def _ue8m0_array(values, out):
    for i in range(values.shape[0]):
        out[i] = _ue8m0(values[i])


# The lane takes decode batches (64 rows of 1536 and more); prefill-sized calls take the general
# path, one launch for both norms on the thread pool.
_MLA_LANE_NUMEL = 1 << 17


def mla_lane(q_latent, kv_a, q_weight, kv_weight, eps, cast):
    """``(q_out, kv_out)`` of a decode-sized call that needs only the kernel, or None (then the
    general, checked path runs).

    :func:`dsnorm.cpu.lane` for the MLA pair: plain CPU tensors of one dtype (bf16/fp16/fp32),
    contiguous ``q_latent`` and ``kv_a`` (576 wide: its first ``kv_lora_rank`` columns are read in
    place), fp32 weights, a valid eps, DeepSeek's cast, decode sizes; nothing taken while autograd
    records, or torch.compile, functorch, a mode, tracing or the profiler is in effect, nor for a
    negated view or a ZeroTensor. It only recognises: anything else, bad input included, returns
    None. Each norm is the core decode kernel's entry point, called directly (the general path's
    checks, weight handling and dispatch cost more than the two norms at a batch of 1).
    """
    if (type(q_latent) not in _PLAIN_TYPES or type(kv_a) not in _PLAIN_TYPES or type(q_weight) not in _PLAIN_TYPES
            or type(kv_weight) not in _PLAIN_TYPES):
        return None
    if cpu._is_grad_enabled() and (q_latent.requires_grad or kv_a.requires_grad or q_weight.requires_grad
                                   or kv_weight.requires_grad):
        return None
    if not cpu.dispatch_free():
        return None
    dtype = q_latent.dtype
    code = cpu._DECODE_CODES.get(dtype)
    if (code is None or kv_a.dtype is not dtype or q_weight.dtype is not _F32 or kv_weight.dtype is not _F32
            or cast != "deepseek" or type(eps) is not float or not _EPS_MIN <= eps <= _EPS_MAX):
        return None
    if not (q_latent.is_cpu and kv_a.is_cpu and q_weight.is_cpu and kv_weight.is_cpu):
        return None
    if q_latent.layout is not _STRIDED or kv_a.layout is not _STRIDED:
        return None
    try:  # free unless a tensor of another layout raises (a weight's): then the general path names it
        if (q_latent.is_neg() or kv_a.is_neg() or q_weight.is_neg() or kv_weight.is_neg()
                or q_latent._is_zerotensor() or kv_a._is_zerotensor() or q_weight._is_zerotensor()
                or kv_weight._is_zerotensor()):
            return None
        if not (q_latent.is_contiguous() and kv_a.is_contiguous() and q_weight.is_contiguous()
                and kv_weight.is_contiguous()) or q_weight.ndim != 1 or kv_weight.ndim != 1:
            return None
        q_shape, kv_shape = q_latent.shape, kv_a.shape
        nq, nkv = q_weight.numel(), kv_weight.numel()
        lead = len(q_shape) - 1
        if lead < 0 or len(kv_shape) != lead + 1 or q_shape[-1] != nq:
            return None
        for i in range(lead):  # the leading shapes match (indexing a torch.Size is cheaper than slicing it)
            if q_shape[i] != kv_shape[i]:
                return None
        kv_width = kv_shape[-1]
        numel = q_latent.numel()
        rows = numel // nq if nq else 0
        if rows == 0 or nkv == 0 or nkv > kv_width or rows * max(nq, nkv) >= _MLA_LANE_NUMEL:
            return None
        addrs = (q_latent.data_ptr(), kv_a.data_ptr(), q_weight.data_ptr(), kv_weight.data_ptr())
    except RuntimeError:
        return None
    q_bytes = numel * q_latent.element_size()
    q_out = torch.empty_like(q_latent) if q_bytes < cpu._PRIME_MIN_BYTES else empty_output(q_latent, dtype)
    kv_out = torch.empty(*kv_shape[:-1], nkv, dtype=dtype)
    # Each norm as the core lane runs it: the decode kernel on this thread, the pool past the serial size.
    entry = cpu._decode_entry or cpu._compile_decode()
    launch = entry if numel < SERIAL_NUMEL else cpu._lane_parallel
    launch(rows, nq, code, addrs[0], nq, 0, addrs[2], q_out.data_ptr(), 0, eps, False, False)
    launch = entry if rows * nkv < SERIAL_NUMEL else cpu._lane_parallel
    launch(rows, nkv, code, addrs[1], kv_width, 0, addrs[3], kv_out.data_ptr(), 0, eps, False, False)
    return q_out, kv_out
