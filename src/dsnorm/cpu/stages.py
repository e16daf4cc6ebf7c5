"""Row stages: a row moved between memory and ``buf``, the kernel's scratch row in the compute
dtype, widened on the way in and rounded once on the way out.

Each stage branches on the dtype code outside its loop, so that every loop is a plain one LLVM
vectorises; all are inlined into the kernels that call them.
"""

from __future__ import annotations

import numba
from numba import njit

from dsnorm.cpu.intrinsics import (
    BF16,
    add_bf16_rows,
    F16,
    F32,
    bf16_to_f32,
    f16_bits_to_f32,
    f32_to_bf16,
    f32_to_bf16_finite,
    f32_to_f16_bits,
    hf_gain_row,
    ptr_f32,
    ptr_f64,
    ptr_u16,
    ptr_u32,
    round_to,
    scale_bf16_rows,
    scale_sum_bf16_rows,
)


@njit(inline="always")
def load_row(addr, offset, code, buf, n, accumulate):
    """buf[:n] (+)= row widened to the compute dtype."""
    if code == BF16:
        p16 = ptr_u16(addr)
        if accumulate:
            for j in range(n):
                buf[j] += bf16_to_f32(p16[offset + j])
        else:
            for j in range(n):
                buf[j] = bf16_to_f32(p16[offset + j])
    elif code == F16:
        p16 = ptr_u16(addr)
        if accumulate:
            for j in range(n):
                buf[j] += f16_bits_to_f32(p16[offset + j])
        else:
            for j in range(n):
                buf[j] = f16_bits_to_f32(p16[offset + j])
    elif code == F32:
        p32 = ptr_f32(addr)
        if accumulate:
            for j in range(n):
                buf[j] += p32[offset + j]
        else:
            for j in range(n):
                buf[j] = p32[offset + j]
    else:
        p64 = ptr_f64(addr)
        if accumulate:
            for j in range(n):
                buf[j] += p64[offset + j]
        else:
            for j in range(n):
                buf[j] = p64[offset + j]


@njit(inline="always")
def store_row(addr, offset, code, buf, n):
    """row = buf[:n] rounded to the dtype ``code``."""
    if code == BF16:
        p16 = ptr_u16(addr)
        for j in range(n):
            p16[offset + j] = f32_to_bf16(numba.float32(buf[j]))
    elif code == F16:
        p16 = ptr_u16(addr)
        for j in range(n):
            p16[offset + j] = f32_to_f16_bits(numba.float32(buf[j]))
    elif code == F32:
        p32 = ptr_f32(addr)
        for j in range(n):
            p32[offset + j] = buf[j]
    else:
        p64 = ptr_f64(addr)
        for j in range(n):
            p64[offset + j] = buf[j]


@njit(inline="always")
def round_row(buf, n, code):
    """buf[:n] = buf rounded to ``code`` and widened again (round_first)."""
    if code == BF16:
        for j in range(n):
            buf[j] = bf16_to_f32(f32_to_bf16(numba.float32(buf[j])))
    elif code == F16:
        for j in range(n):
            buf[j] = f16_bits_to_f32(f32_to_f16_bits(numba.float32(buf[j])))
    elif code == F32:
        for j in range(n):
            buf[j] = numba.float32(buf[j])


@njit(inline="always")
def _load_add_bf16_row(x_addr, x_off, r_addr, r_off, buf, n):
    """buf = x + r, bf16 rows widened, in one loop (load_row twice would write buf, then read it
    back to add)."""
    px = ptr_u16(x_addr)
    pr = ptr_u16(r_addr)
    for j in range(n):
        buf[j] = bf16_to_f32(px[x_off + j]) + bf16_to_f32(pr[r_off + j])


@njit(inline="always")
def _load_add_store_row(x_addr, x_off, r_addr, r_off, o_addr, o_off, code, buf, n, round_first):
    """The fused load stage in one loop, all three rows of one dtype: buf = x + r (rounded to
    ``code`` first for round_first), residual_out = buf rounded to ``code`` (bf16 rows without
    AVX512-BF16 take it for round_first only: forward_rows' late_rout)."""
    if code == BF16 and o_addr == r_addr and o_off == r_off:
        # In place: one pointer for the residual's read and write, so LLVM sees the same address
        # (distance 0) and vectorises; two pointers to the same row fail its runtime overlap check
        # and drop to the scalar loop.
        pr = ptr_u16(r_addr)
        px = ptr_u16(x_addr)
        start = add_bf16_rows(x_addr + 2 * x_off, r_addr + 2 * r_off, r_addr + 2 * r_off, buf, n, round_first)
        for j in range(start, n):
            v = bf16_to_f32(px[x_off + j]) + bf16_to_f32(pr[r_off + j])
            bits = f32_to_bf16(v)
            pr[r_off + j] = bits
            buf[j] = bf16_to_f32(bits) if round_first else v
    elif code == BF16:
        px = ptr_u16(x_addr)
        pr = ptr_u16(r_addr)
        po = ptr_u16(o_addr)
        start = add_bf16_rows(x_addr + 2 * x_off, r_addr + 2 * r_off, o_addr + 2 * o_off, buf, n, round_first)
        for j in range(start, n):
            v = bf16_to_f32(px[x_off + j]) + bf16_to_f32(pr[r_off + j])
            bits = f32_to_bf16(v)
            po[o_off + j] = bits
            buf[j] = bf16_to_f32(bits) if round_first else v
    elif code == F16:
        hx = ptr_u16(x_addr)
        hr = ptr_u16(r_addr)
        ho = ptr_u16(o_addr)
        for j in range(n):
            v = f16_bits_to_f32(hx[x_off + j]) + f16_bits_to_f32(hr[r_off + j])
            bits = f32_to_f16_bits(v)
            ho[o_off + j] = bits
            buf[j] = f16_bits_to_f32(bits) if round_first else v
    elif code == F32:
        fx = ptr_f32(x_addr)
        fr = ptr_f32(r_addr)
        fo = ptr_f32(o_addr)
        for j in range(n):
            v = fx[x_off + j] + fr[r_off + j]
            fo[o_off + j] = v
            buf[j] = v
    else:
        dx = ptr_f64(x_addr)
        dr = ptr_f64(r_addr)
        do = ptr_f64(o_addr)
        for j in range(n):
            v = dx[x_off + j] + dr[r_off + j]
            do[o_off + j] = v
            buf[j] = v


@njit(inline="always")
def _bf16_bits(value, finite):
    """f32_to_bf16, or for a value known not to be NaN (``finite``) its cheaper form."""
    return f32_to_bf16_finite(value) if finite else f32_to_bf16(value)


@njit(inline="always")
def _bf16_round(value, finite):
    """round_to(value, BF16), or for a value known not to be NaN its cheaper form."""
    return bf16_to_f32(_bf16_bits(numba.float32(value), finite))


@njit(inline="always")
def _scaled_bf16(w, v, rstd, cast_hf, finite):
    """y's bf16 bits: ``w * (v * rstd)`` rounded once, or in the Hugging Face order ``round(w) *
    round(v * rstd)`` rounded (round: to bf16 and back); intrinsics.scale_bf16_rows is its vector
    form. ``finite``: v is finite, rstd the row's and w finite in bf16 too (gain_is_finite), so
    that no value rounded is NaN."""
    if cast_hf:
        return _bf16_bits(_bf16_round(w, finite) * _bf16_round(v * rstd, finite), finite)
    return _bf16_bits(w * (v * rstd), finite)


@njit(inline="always")
def _scaled_bf16_loop(pb, offset, po, o_off, buf, wb, rstd, start, n, cast_hf, finite, with_o):
    """bf16 y from ``start`` (and residual_out, the scratch row rounded, ``with_o``); the flags are
    literals at each call, so that each loop is straight-line code."""
    for j in range(start, n):
        v = buf[j]
        if with_o:
            po[o_off + j] = _bf16_bits(v, finite)
        pb[offset + j] = _scaled_bf16(wb[j], v, rstd, cast_hf, finite)


@njit(inline="always")
def _scaled_bf16_rows(pb, offset, po, o_off, buf, wb, rstd, start, n, cast_hf, finite, with_o):
    """_scaled_bf16_loop with ``cast_hf`` and ``finite`` passed on as literals (``with_o`` is one
    at each call): the branches here, outside the loops."""
    if finite:
        if cast_hf:
            _scaled_bf16_loop(pb, offset, po, o_off, buf, wb, rstd, start, n, True, True, with_o)
        else:
            _scaled_bf16_loop(pb, offset, po, o_off, buf, wb, rstd, start, n, False, True, with_o)
    elif cast_hf:
        _scaled_bf16_loop(pb, offset, po, o_off, buf, wb, rstd, start, n, True, False, with_o)
    else:
        _scaled_bf16_loop(pb, offset, po, o_off, buf, wb, rstd, start, n, False, False, with_o)


@njit(inline="always")
def store_scaled_row(addr, offset, code, buf, w_addr, rstd, n, cast_hf, o_addr, o_off, finite):
    """row = (w * (buf * rstd)) rounded once to ``code``; Hugging Face order with ``cast_hf`` (bf16
    rows on AVX512-BF16 targets: w from :func:`hf_gain`). bf16 only: residual_out (``o_addr``, 0 for none)
    = buf rounded, and ``finite``: the row's sum is finite and the gain finite in bf16, so no
    value rounded is NaN (see forward_rows)."""
    if code == BF16:
        wb = ptr_f32(w_addr)
        pb = ptr_u16(addr)
        po = ptr_u16(o_addr)
        if o_addr != 0:  # only targets without AVX512-BF16 pass it
            _scaled_bf16_rows(pb, offset, po, o_off, buf, wb, rstd, 0, n, cast_hf, finite, True)
        else:
            # The vector part where the target has AVX512-BF16, then the scalar loop.
            start = scale_bf16_rows(addr + 2 * offset, buf, w_addr, rstd, n, cast_hf)
            _scaled_bf16_rows(pb, offset, po, o_off, buf, wb, rstd, start, n, cast_hf, finite, False)
    elif code == F16:
        wh = ptr_f32(w_addr)
        ph = ptr_u16(addr)
        if cast_hf:
            for j in range(n):
                ph[offset + j] = f32_to_f16_bits(round_to(wh[j], F16) * round_to(buf[j] * rstd, F16))
        else:
            for j in range(n):
                ph[offset + j] = f32_to_f16_bits(wh[j] * (buf[j] * rstd))
    elif code == F32:
        wf = ptr_f32(w_addr)
        pf = ptr_f32(addr)
        for j in range(n):
            pf[offset + j] = wf[j] * (buf[j] * rstd)
    else:
        wd = ptr_f64(w_addr)
        pd = ptr_f64(addr)
        for j in range(n):
            pd[offset + j] = wd[j] * (buf[j] * rstd)


@njit(inline="always")
def store_sum_scaled_row(x_addr, x_off, r_addr, r_off, o_addr, o_off, y_addr, y_off, w_addr, rstd, n, cast_hf,
                         stream):
    """The output stage without a scratch row, bf16 rows and an fp32 gain: ``s = x + r`` read again
    (``r_addr`` 0: ``s = x``), residual_out = s rounded (with r), y = (w * (s * rstd)) rounded once
    (Hugging Face order with ``cast_hf``); o may be r and y may be x (each element is read before
    it is written). With ``cast_hf`` w is from :func:`hf_gain`; ``stream``: non-temporal stores for the
    vector part (the caller fences)."""
    start = scale_sum_bf16_rows(x_addr + 2 * x_off, r_addr + 2 * r_off if r_addr != 0 else r_addr,
                                o_addr + 2 * o_off, y_addr + 2 * y_off, w_addr, rstd, n, cast_hf, stream)
    px = ptr_u16(x_addr)
    pr = ptr_u16(r_addr)
    po = ptr_u16(o_addr)
    py = ptr_u16(y_addr)
    wb = ptr_f32(w_addr)
    for j in range(start, n):
        v = bf16_to_f32(px[x_off + j])
        if r_addr != 0:
            v += bf16_to_f32(pr[r_off + j])
            po[o_off + j] = f32_to_bf16(v)
        py[y_off + j] = _scaled_bf16(wb[j], v, rstd, cast_hf, False)


@njit(inline="always")
def gain_is_finite(w_addr, n):
    """Whether every value of the fp32 gain row at ``w_addr`` is finite and stays finite rounded
    to bf16 (the Hugging Face order rounds it: from 0x7F7F8000 on, a magnitude rounds to inf, and
    inf * 0 is a NaN)."""
    # A magnitude's bits are 0x7F7F8000 or more exactly where adding 0x00808000 sets the top bit:
    # an OR reduction, which LLVM vectorises (a max or a compare in the loop it left scalar), each
    # step cast back to uint32 (numba widens uint32 arithmetic to 64 bits: half as many lanes).
    p32 = ptr_u32(w_addr)
    bits = numba.uint32(0)
    for j in range(n):
        magnitude = numba.uint32(p32[j] & numba.uint32(0x7FFFFFFF))
        bits = numba.uint32(bits | numba.uint32(magnitude + numba.uint32(0x00808000)))
    return bits < numba.uint32(0x80000000)


@njit(inline="always")
def hf_gain(dst, w_addr, w_code, n, quads):
    """dst[:n] = the gain at ``w_addr`` (dtype ``w_code``: fp32 or bf16) as the Hugging Face
    order's bf16 output stages on AVX512-BF16 targets read it: rounded to bf16 once per call instead
    of once per element (a NaN to 0x7FC0, or in a bf16 gain's vector part kept as it is: y is a NaN
    there, rounded to 0x7FC0, either way), whole 32s laid out by
    :func:`dsnorm.cpu.intrinsics.hf_gain_row` (``quads``: for the stages that read no scratch row),
    the tail in element order, where the stages' scalar loops read it (rounding it again changes
    nothing)."""
    if w_code != F32 and w_code != BF16:  # widens_gain widens the others first
        raise ValueError("hf_gain: an fp32 or bf16 gain only")
    start = hf_gain_row(dst, w_addr, w_code, n, quads)
    tail = dst[start:n]
    load_row(w_addr, start, w_code, tail, n - start, False)
    round_row(tail, n - start, BF16)


@njit(inline="always")
def load_span(
    lo, hi, buf, row, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    rout_addr, rout_stride, rout_code, round_first, fused_one_dtype,
):
    """Elements [lo, hi) of a row: s = x (+ residual) into buf, residual_out stored where
    ``rout_addr`` is not 0 (forward_rows may store it in the output stage instead)."""
    span = buf[lo:hi]
    m = hi - lo
    if res_addr == 0:
        load_row(x_addr, row * x_stride + lo, x_code, span, m, False)
    elif fused_one_dtype:
        _load_add_store_row(
            x_addr, row * x_stride + lo, res_addr, row * res_stride + lo, rout_addr, row * rout_stride + lo,
            x_code, span, m, round_first,
        )
    elif x_code == BF16 and res_code == BF16 and not round_first:
        _load_add_bf16_row(x_addr, row * x_stride + lo, res_addr, row * res_stride + lo, span, m)
        if rout_addr != 0:
            store_row(rout_addr, row * rout_stride + lo, rout_code, span, m)
    else:
        load_row(x_addr, row * x_stride + lo, x_code, span, m, False)
        load_row(res_addr, row * res_stride + lo, res_code, span, m, True)
        if round_first:
            round_row(span, m, x_code)
        if rout_addr != 0:
            store_row(rout_addr, row * rout_stride + lo, rout_code, span, m)
