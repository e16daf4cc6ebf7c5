"""The forward and backward kernels: a rows kernel that does the work, and the serial and parallel
kernels that call it (plus the decode kernel, a serial one with fewer arguments).

* One pass over memory: each row is widened once into a per-thread scratch row in the compute dtype
  (it stays in L1/L2), which the sum (:mod:`dsnorm.cpu.cascade`, torch's order) and the output
  stage then read; inputs are read once from memory, outputs written once. On CPUs with
  AVX512-BF16, wide one-dtype bf16 rows in fp32 compute (not ``round_first``) skip it but for a
  row's tail: the sum reads the inputs, and the output stage reads them again from L2 (see
  forward_rows). Then, as torch computes it, ``mean = sum / n`` (true division), ``rstd = 1 /
  sqrt(mean + eps)`` (torch's CPU rsqrt), ``xhat = s * rstd`` and only then ``weight * xhat``.
* Calls by address: a parallel kernel calls its per-thread rows kernel through the rows kernel's
  compiled address, handed to it as an argument, instead of by name. Called by name, numba links
  the callee's whole machine-code module into the parallel kernel's and LLVM optimises the linked
  callee again at each of the four stages that build a parallel kernel (its body as a gufunc, the
  gufunc's wrapper, the kernel, its Python wrapper), for code compiled already. Called by address
  (:func:`dsnorm.cpu.intrinsics.by_address`), the rows kernel is compiled (or loaded from the
  cache) once, with the serial kernels that call it by name.
* A kernel calls another with typed values (``I0``, ``NO``), never literals: numba compiles a
  called kernel once per signature and types a literal ``0`` as ``Literal[int](0)``, so a caller
  passing ``0`` where another passes a computed value costs one more compilation of the callee.
* dweight is reduced over fixed row blocks whose size depends only on the shape, then the blocks
  are added in block order: the same bits for any thread count.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types

from dsnorm.cpu.cascade import (
    ACC_SLOTS,
    SUM_LANES,
    sum_finish,
    sum_layout,
    sum_step,
    sum_step_bf16,
    sumsq_narrow,
)
from dsnorm.cpu.intrinsics import (
    BF16,
    BF16_CVT,
    F32,
    F64,
    by_address,
    code_size,
    prefetch_line,
    ptr_f32,
    ptr_f64,
    stack_f32,
    store_fence,
)
from dsnorm.cpu.runtime import kernel
from dsnorm.cpu.stages import (
    hf_gain,
    gain_is_finite,
    load_row,
    load_span,
    round_row,
    store_row,
    store_scaled_row,
    store_sum_scaled_row,
)

# This module's kernels compile those of the modules above into themselves: the digest of their
# sources (see dsnorm.cpu.runtime) makes a change to any of them a change to this file.
DEPENDENCIES_SHA256 = 'ada1bfa053f5525c4af7c07d8ee4b2f91fb2eec39126e3fde03b31355162ecb4'

# Software prefetch of the next row, interleaved with the store pass (see forward_rows): every
# _PREFETCH_BYTES of output stored, the matching 64-byte lines of the next row's inputs are
# requested. It pays only for rows that come from DRAM: rows of at least _PREFETCH_MIN_WIDTH
# elements and a thread's share of x of at least _PREFETCH_MIN_BYTES; in place (the sum written
# over the residual and y over x) also from L3, for rows of at least _PREFETCH_IN_PLACE_MIN_WIDTH
# once a thread's share of x passes its L2. Elsewhere it costs time.
_PREFETCH_BYTES = 256
# The store pass runs chunk by chunk, each chunk reading the gain from its first element on; the
# Hugging Face order's prepared gain (bf16 rows) is laid out by 32 values from element 0 (hf_gain),
# so a bf16 chunk must be a whole number of those blocks.
assert (_PREFETCH_BYTES // 2) % 32 == 0
_PREFETCH_MIN_WIDTH = 1024
_PREFETCH_MIN_BYTES = 8 << 20
_PREFETCH_IN_PLACE_MIN_WIDTH = 4096
_PREFETCH_IN_PLACE_MIN_BYTES = 2 << 20
# Outputs that do not overwrite the inputs, from a thread's share of x of this many bytes on, are
# written with non-temporal stores (the path that reads no scratch row; see forward_rows): an
# ordinary store first reads each line of a fresh output for ownership, and outputs this large leave
# the caches before anything reads them. Over inputs (in place) the lines are cached already, and a
# non-temporal store evicts them: slower there.
_STREAM_MIN_BYTES = 8 << 20


# Out of line, called by forward_rows: inlined there, the register sum made the wide rows' threaded
# fused calls fault in a fresh output now and then (in some processes, some calls; none before it or
# with this call; why is not understood). The call costs narrow rows a few percent.
@kernel()
def _narrow_total(buf, n):
    return sumsq_narrow(buf, n)


# A zero and a False typed int64 / bool, for kernels calling kernels (see the module docstring).
I0 = np.int64(0)
NO = np.bool_(False)


@njit(inline="always")
def compute_code(scratch):
    """The dtype code of the compute dtype (a scratch row's), typed: a gain's in that dtype."""
    return np.int64(F32) if scratch.itemsize == 4 else np.int64(F64)


@njit(inline="always")
def prepares_gain(cast_hf, x_code, compute_size):
    """Whether forward_rows lays the gain out itself (hf_gain), from an fp32 one or a bf16 one: the
    Hugging Face order's bf16 rows in fp32 compute (``compute_size`` 4), on AVX512-BF16 targets."""
    return BF16_CVT and cast_hf and x_code == BF16 and compute_size == 4


@njit(inline="always")
def widens_gain(w_code, cast_hf, x_code):
    """Whether a caller of forward_rows in fp32 compute widens the gain first (thread_gain): a
    bf16/fp16 one, but for a bf16 one that forward_rows lays out from its bits."""
    return w_code != F32 and not (w_code == BF16 and prepares_gain(cast_hf, x_code, 4))


def scratch_types(ndim: int) -> dict:
    """C-contiguous scratch arrays of ``ndim`` dimensions by compute dtype (x64: float64)."""
    return {x64: types.Array(types.float64 if x64 else types.float32, ndim, "C") for x64 in (False, True)}


I64 = types.int64
ROW = scratch_types(1)
ROWS = scratch_types(2)
# forward_rows' argument types by compute dtype (x64): every caller passes these.
FORWARD_ROWS_SIGNATURES = {
    x64: (I64,) * 3 + (ROW[x64],) + (I64,) * 14 + (types.float64, types.boolean, types.boolean)
    for x64 in (False, True)
}
_call_forward_rows = by_address(*FORWARD_ROWS_SIGNATURES.values())


# Not inlined: numba's parfor pass analyses what it inlines into a prange body and dropped the
# rstd store made through a raw pointer there (a wrong result, found by the tests). A call is
# opaque to it, and costs one call per thread. Its callers pass typed values, never literals (see
# the module docstring; tests/test_fusions.py checks the calls).
@kernel()
def forward_rows(
    r0, r1, n, scratch,
    x_addr, x_stride, x_code,
    res_addr, res_stride, res_code,
    w_addr, w_code,
    y_addr, y_stride,
    rout_addr, rout_stride, rout_code,
    rstd_addr, eps_f64, cast_hf, round_first,
):
    buf = scratch[:n]
    acc = scratch[n:]
    lanes_max = SUM_LANES if scratch.itemsize == 4 else SUM_LANES // 2
    # Constants in the compute dtype, through the scratch (numba would widen a float32 op with a
    # Python number to f64): eps rounded to fp32 as torch does for ``var + eps``, and the width.
    acc[0] = eps_f64
    eps = acc[0]
    one = eps / eps
    acc[0] = n
    width = acc[0]  # the mean is a true division by the width, as in torch
    # The one-loop fused stage where all three rows share a dtype (bf16 without AVX512-BF16 takes
    # it for round_first only: see late_rout); in place it has a bf16 form only (other dtypes take
    # the stage-per-loop path, whose loops each touch one external row and so vectorise).
    fused_one_dtype = (
        res_code == x_code and rout_code == x_code and rout_addr != 0
        and (rout_addr != res_addr or x_code == BF16)
    )
    lanes, nvec, groups, group_len, level_power = sum_layout(n, lanes_max)
    step_len = group_len << level_power
    x_size = code_size(x_code)
    res_size = code_size(res_code)
    w_size = scratch.itemsize  # the gain is in the compute dtype (w_code), or laid out in it (hf_row)
    in_place_wide = res_addr != 0 and rout_addr == res_addr and n >= _PREFETCH_IN_PLACE_MIN_WIDTH
    min_bytes = _PREFETCH_IN_PLACE_MIN_BYTES if in_place_wide else _PREFETCH_MIN_BYTES
    prefetch = n >= _PREFETCH_MIN_WIDTH and (r1 - r0) * n * x_size >= min_bytes
    chunk = _PREFETCH_BYTES // x_size  # elements stored between two rounds of prefetches
    # Up to one whole level step: with exactly 2**level_power groups the array form's one step moves
    # level 0 into a zeroed level 1 and back (0 + c is c), the register form's single chain.
    narrow = lanes == lanes_max and groups <= (1 << level_power)
    # One-dtype bf16 rows of a wide row, fp32 compute, where the target rounds a vector at once
    # (intrinsics.BF16_CVT): the sum reads the inputs themselves, and the output stage reads them
    # again instead of an fp32 scratch row. The sum's order is the same; only a row's tail past its
    # whole level steps goes through the scratch. A row is read faster that way wherever it is, a
    # fused one too (two inputs to read again, the sum to round in the output stage), in either
    # order (docs/performance.md).
    wide_bf16 = (
        BF16_CVT and x_code == BF16 and scratch.itemsize == 4 and not round_first and not narrow
        and lanes == lanes_max
    )
    direct = wide_bf16 and (res_addr == 0 or fused_one_dtype)
    # The Hugging Face order's bf16 output stages on AVX512-BF16 targets read the gain rounded to
    # bf16 once for this thread's rows, not per element, and laid out by 32s as they read it
    # (hf_gain; a bf16 gain straight from its bits, which the callers leave unwidened: widens_gain);
    # with fp32 compute (w_size 4) their vector parts always run, so no scalar loop reads a laid-out
    # block. The row loop reads its address, so that numba, which frees an array after its last
    # use, keeps it.
    hf_row = prepares_gain(cast_hf, x_code, scratch.itemsize)
    gain_row = np.empty(n, dtype=scratch.dtype) if hf_row else scratch[:0]
    if hf_row:
        hf_gain(gain_row, w_addr, w_code, n, direct)
    # Elsewhere the bit trick rounds, and a row whose sum is finite, under a gain that stays finite
    # in bf16 (gain_is_finite), holds no NaN to round: s is finite, rstd finite, and w * (s * rstd)
    # (or round(w) * round(s * rstd)) finite or infinite. Its roundings skip the NaN test
    # (intrinsics.f32_to_bf16_finite). One-dtype fp32_sum fused rows then store residual_out in the
    # output stage, from the scratch row, when the row's sum is known, instead of in the load stage.
    trick_bf16 = not BF16_CVT and x_code == BF16 and w_size == 4
    gain_finite = trick_bf16 and gain_is_finite(w_addr, n)
    late_rout = trick_bf16 and fused_one_dtype and not round_first
    span_rout = I0 if direct or late_rout else rout_addr  # residual_out stored in the load stage
    stream = (
        direct and y_addr != x_addr and (res_addr == 0 or rout_addr != res_addr)
        and (r1 - r0) * n * x_size >= _STREAM_MIN_BYTES
    )
    for row in range(r0, r1):
        if not narrow:
            for t in range(group_len, 4 * group_len):
                acc[t] = 0.0
        # A wide row is loaded a level step at a time and each step summed while it is still in
        # L1 (one pass over the row instead of a load pass and a sum pass; the sum's order is
        # unchanged), then the rest; a narrow row in one span. One call site for each inlined stage:
        # numba copies the stage's IR into every site, and each copy lengthens the first compile.
        i = 0
        lo = 0
        x_row = x_addr + row * x_stride * x_size
        res_row = res_addr + row * res_stride * res_size if res_addr != 0 else res_addr
        while True:
            full_step = not narrow and i + (1 << level_power) <= groups
            if direct and full_step:
                i = sum_step_bf16(x_row, res_row, i, level_power, acc)
                lo += step_len
                continue
            hi = lo + step_len if full_step else n
            load_span(lo, hi, buf, row, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
                      span_rout, rout_stride, rout_code, round_first, fused_one_dtype and not direct and not late_rout)
            if not full_step:
                break
            i = sum_step(buf, i, lanes, level_power, acc)
            lo = hi
        total = _narrow_total(buf, n) if narrow else sum_finish(buf, n, i, lanes, nvec, groups, acc)
        rstd = one / np.sqrt(total / width + eps)
        finite = gain_finite and total - total == 0.0
        if rstd_addr != 0:
            if scratch.itemsize == 4:
                ptr_f32(rstd_addr)[row] = rstd
            else:
                ptr_f64(rstd_addr)[row] = rstd
        # While this row is scaled and stored (no DRAM reads of its own), fetch the next one: without
        # it the memory system idles for that pass and the two threads only overlap it by chance.
        # Without prefetching the row is stored in one chunk: one call site, as above.
        w_row = np.int64(gain_row.ctypes.data) if hf_row else w_addr
        prefetching = prefetch and row + 1 < r1
        next_x = x_addr + (row + 1) * x_stride * x_size
        next_res = res_addr + (row + 1) * res_stride * res_size
        lo = 0
        while lo < n:
            hi = min(lo + chunk, n) if prefetching else n
            if prefetching:
                for offset in range(lo * x_size, hi * x_size, 64):
                    prefetch_line(next_x + offset)
                if res_addr != 0:
                    for offset in range(lo * res_size, hi * res_size, 64):
                        prefetch_line(next_res + offset)
            if direct:
                store_sum_scaled_row(x_addr, row * x_stride + lo, res_addr, row * res_stride + lo,
                                     rout_addr, row * rout_stride + lo, y_addr, row * y_stride + lo,
                                     w_row + w_size * lo, rstd, hi - lo, cast_hf, stream)
            else:
                store_scaled_row(y_addr, row * y_stride + lo, x_code, buf[lo:hi], w_row + w_size * lo, rstd,
                                 hi - lo, cast_hf, rout_addr if late_rout else I0,
                                 row * rout_stride + lo, finite)
            lo = hi
    if stream:
        store_fence()


@kernel()
def forward_serial32(
    rows, n,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    # The scratch row is allocated here: handing numba an array costs more than the allocation.
    forward_rows(
        I0, rows, n, np.empty(n + ACC_SLOTS, dtype=np.float32),
        x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, np.int64(F32), y_addr, y_stride,
        rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
    )


@kernel()
def forward_serial64(
    rows, n,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    forward_rows(
        I0, rows, n, np.empty(n + ACC_SLOTS, dtype=np.float64),
        x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, np.int64(F64), y_addr, y_stride,
        rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
    )


# Floats of decode scratch on the stack at most: 8.7 KiB, the latent norms' widths (1536, 512; with
# a narrow gain widened beside the row, 512 only: 1536 then takes the heap). A thread's stack may be
# as small as 32 KiB (threading.stack_size's minimum): 33 KiB of scratch (every width to 8192)
# crashed such a thread at 7168, and 17 KiB (4096) left it little room.
_STACK_SCRATCH = 2048 + ACC_SLOTS


@kernel()
def thread_gain(n, w_addr, w_code, scratch_row, cast_hf, x_code):
    # forward_rows' gain for one thread's rows (the decode kernel's, or one thread's of a parallel
    # launch), as (address, dtype code): the gain itself where it is in the compute dtype or
    # forward_rows lays it out from its bits (widens_gain), else (a bf16/fp16 gain: vLLM keeps
    # its gains in the model's dtype) the gain widened, exactly, into this thread's scratch row past
    # the row and its accumulators: what weight.to(float32) gives, without a call of its own. Each
    # thread widening its own copy costs less than one row widened by the calling thread, which
    # the other threads then had to fetch from its core's cache on every call.
    if w_code == F64 or not widens_gain(w_code, cast_hf, x_code):
        return w_addr, w_code
    gain = scratch_row[n + ACC_SLOTS:2 * n + ACC_SLOTS]
    load_row(w_addr, 0, w_code, gain, n, False)
    return np.int64(gain.ctypes.data), np.int64(F32)


@kernel()
def decode32(rows, n, code, x_addr, x_stride, res_addr, w_addr, w_code, y_addr, rout_addr, eps, cast_hf,
             round_first):
    # Rows of one dtype, all contiguous but x's: the serial kernel with a third of the arguments
    # (unboxing each one is a noticeable part of a decode norm). The scratch row of a narrow call
    # is on the stack: a heap array costs more (the allocation, its reference counts); wider rows
    # keep the heap. A bf16/fp16 gain (w_code) may be widened into the scratch's tail first
    # (thread_gain).
    width = n + ACC_SLOTS
    total = width + n if widens_gain(w_code, cast_hf, code) else width
    if total <= _STACK_SCRATCH:
        scratch = numba.carray(stack_f32(total), total)
    else:
        scratch = np.empty(total, dtype=np.float32)
    gain_addr, gain_code = thread_gain(n, w_addr, w_code, scratch, cast_hf, code)
    forward_rows(
        I0, rows, n, scratch[:width],
        x_addr, x_stride, code, res_addr, n, code, gain_addr, gain_code, y_addr, n,
        rout_addr, n, code, I0, eps, cast_hf, round_first,
    )


@kernel(parallel=True)
def forward_parallel(
    rows_kernel, rows, n, scratch,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, w_code, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    # rows_kernel: forward_rows' address for this scratch dtype (see the module docstring).
    # w_code: the gain's dtype, the compute dtype's or (fp32 compute) bf16/fp16; scratch rows of
    # 2 * n + ACC_SLOTS values (thread_gain).
    # One contiguous block of rows per thread; a row's bits never depend on the split.
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        gain_addr, gain_code = thread_gain(n, w_addr, w_code, scratch[t], cast_hf, x_code)
        _call_forward_rows(rows_kernel, (
            rows * t // nthreads, rows * (t + 1) // nthreads, n, scratch[t],
            x_addr, x_stride, x_code, res_addr, res_stride, res_code, gain_addr, gain_code,
            y_addr, y_stride, rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
        ))


@njit(inline="always")
def _dot(a, b, n, zero):
    """sum(a[:n] * b[:n]) with eight interleaved accumulators (a fixed order, so deterministic):
    one running sum would be a chain of n dependent adds."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
    full = n - n % 8
    for j in range(0, full, 8):
        a0 += a[j] * b[j]
        a1 += a[j + 1] * b[j + 1]
        a2 += a[j + 2] * b[j + 2]
        a3 += a[j + 3] * b[j + 3]
        a4 += a[j + 4] * b[j + 4]
        a5 += a[j + 5] * b[j + 5]
        a6 += a[j + 6] * b[j + 6]
        a7 += a[j + 7] * b[j + 7]
    for j in range(full, n):
        a0 += a[j] * b[j]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@kernel()  # not inlined, for the same reason as forward_rows
def _backward_block(
    r0, r1, n, buf, g, dw,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """Rows [r0, r1): dx, dresidual, and this block's dweight partial (``dw``, written)."""
    cd64 = buf.itemsize == 8
    for j in range(n):
        dw[j] = 0.0
    # Compute-dtype constants (a Python number would widen float32 arithmetic to f64).
    zero = dw[0]
    buf[0] = n
    width = buf[0]
    for row in range(r0, r1):
        load_row(x_addr, row * x_stride, x_code, buf, n, False)
        if res_addr != 0:
            load_row(res_addr, row * res_stride, res_code, buf, n, True)
            if round_first:
                round_row(buf, n, x_code)
        # Read through the scratch so rstd keeps the compute dtype in both specialisations.
        if cd64:
            g[0] = ptr_f64(rstd_addr)[row]
        else:
            g[0] = ptr_f32(rstd_addr)[row]
        rstd = g[0]
        load_row(dy_addr, row * dy_stride, x_code, g, n, False)
        if cd64:
            w64 = ptr_f64(w_addr)
            for j in range(n):
                buf[j] = buf[j] * rstd
                dw[j] += g[j] * buf[j]
                g[j] = g[j] * w64[j]
        else:
            w32 = ptr_f32(w_addr)
            for j in range(n):
                buf[j] = buf[j] * rstd
                dw[j] += g[j] * buf[j]
                g[j] = g[j] * w32[j]
        mean_dot = _dot(g, buf, n, zero) / width
        for j in range(n):
            g[j] = rstd * (g[j] - buf[j] * mean_dot)
        if dro_addr != 0:
            load_row(dro_addr, row * dro_stride, dro_code, g, n, True)
        store_row(dx_addr, row * dx_stride, x_code, g, n)
        if dres_addr != 0:
            store_row(dres_addr, row * dres_stride, res_code, g, n)


@kernel()
def backward_share(
    t, nthreads, rows, n, block_rows, scratch, partials,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """Thread ``t``'s share of the backward's first phase: its consecutive run of the fixed row
    blocks (fixed by ``(rows, block_rows)``; threads only decide who computes which block), with its
    own scratch row."""
    nblocks = partials.shape[0]
    buf = scratch[t, :n]
    g = scratch[t, n:]
    for b in range(nblocks * t // nthreads, nblocks * (t + 1) // nthreads):
        _backward_block(
            b * block_rows, min(rows, (b + 1) * block_rows), n, buf, g, partials[b],
            dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
            w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
            dx_addr, dx_stride, dres_addr, dres_stride, round_first,
        )


@njit(inline="always")
def _column_total(partials, j):
    """Column ``j`` of the partials summed over the blocks in block order."""
    total = partials[0, j]
    for b in range(1, partials.shape[0]):
        total += partials[b, j]
    return total


@kernel()
def _dweight_columns(partials, dw_addr, j0, j1):
    """dweight[j0:j1] (at ``dw_addr``, the partials' dtype), each column summed over the blocks in
    block order: deterministic dweight. Written in place: the tensor's memory, not a copy."""
    if partials.itemsize == 8:
        out64 = ptr_f64(dw_addr)
        for j in range(j0, j1):
            out64[j] = _column_total(partials, j)
    else:
        out32 = ptr_f32(dw_addr)
        for j in range(j0, j1):
            out32[j] = _column_total(partials, j)


# backward_share's argument types by compute dtype (x64).
BACKWARD_SHARE_SIGNATURES = {
    x64: (I64,) * 5 + (ROWS[x64],) * 2 + (I64,) * 17 + (types.boolean,) for x64 in (False, True)
}
_call_backward_share = by_address(*BACKWARD_SHARE_SIGNATURES.values())


@kernel(parallel=True)
def backward_kernel(
    share_kernel, rows, n, block_rows, scratch, partials, dw_addr,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    # share_kernel: backward_share's address for this scratch dtype (as in forward_parallel).
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        # t as int64: prange's index is uint64, the serial kernel's int64 (one signature).
        _call_backward_share(share_kernel, (
            np.int64(t), nthreads, rows, n, block_rows, scratch, partials,
            dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
            w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
            dx_addr, dx_stride, dres_addr, dres_stride, round_first,
        ))
    for t in prange(nthreads):
        _dweight_columns(partials, dw_addr, n * t // nthreads, n * (t + 1) // nthreads)


@kernel()
def backward_serial(
    rows, n, block_rows, scratch, partials, dw_addr,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """``backward_kernel`` on the calling thread: one share holding every block, then every
    column, so the same bits, with no launch on numba's pool (a forked child must not touch a GNU
    OpenMP pool that ran in its parent; and one thread gains nothing from a launch)."""
    backward_share(
        I0, I0 + 1, rows, n, block_rows, scratch, partials,
        dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
        w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
        dx_addr, dx_stride, dres_addr, dres_stride, round_first,
    )
    _dweight_columns(partials, dw_addr, I0, n)
