"""Triton kernels: RMSNorm forward (plain / fused residual add) and backward.

One kernel per direction; the variants (residual or not, round-first, HF cast, rstd saved, fp32
or fp64 compute) are compile-time flags, so every variant is the same code path with branches
removed at compile time.

Why the kernels look the way they do:

* Exactness is defined by ``dsnorm.ref``: ``s = x (+ residual)`` widened to the compute dtype,
  ``rstd = 1 / sqrt(sum(s*s) / n + eps)`` with IEEE-rounded division and square root
  (``div_rn`` / ``sqrt_rn``: Triton's plain ``/`` and ``sqrt`` are approximate for fp32 on
  NVIDIA), ``xhat = s * rstd``, then ``weight * xhat`` and one rounding to the output dtype. The
  only freedom taken is the order of the sum of squares (a tree instead of torch's cascade): the
  forward launches turn off Triton's fp fusion (``launch.FWD_OPTIONS``), which would keep one
  square of each pair unrounded inside an fma.
* Conversions between bf16 and fp32: compiled for a GPU, the hardware's own (``cvt.rn.bf16x2.f32``
  rounds to nearest even; widening is exact), one instruction per two elements. Under Triton's
  interpreter (``TRITON_INTERPRET=1``, which the CPU tests use) integer bit arithmetic instead:
  round to nearest even with NaN kept NaN on the way down, a 16-bit shift on the way up, because
  the interpreter's own ``.to(tl.bfloat16)`` truncates and its widening flushes subnormals. Both
  give the same bits (NaN payloads aside); the choice is made when this module is imported
  (``BIT_ARITHMETIC``). The bit arithmetic used to run on the GPU too: about a dozen integer ops per
  element, which on an H200 held the fused forward at 84% of copy bandwidth against 97% without
  it (benchmarks/gpu_configs.py, [16384, 7168] bf16).
* Each program owns whole rows (``ROWS_PER_PROG`` consecutive rows) and the per-row arithmetic
  depends only on ``n`` and the dtypes (through ``BLOCK_N`` and the launch's warp count), never on
  the number of rows: a row's bits are the same in a launch of 1 row or of 16384 (batch invariance).
* Rows wider than ``BLOCK_N`` take two passes over global memory (sum of squares, then output);
  the second pass re-reads the inputs rather than the outputs, so in-place calls (``y is x``,
  ``residual_out is residual``) stay correct.
* Only builtins of ``triton.language`` are called (``tl.full`` rather than ``tl.zeros``, a
  ``tl.reduce`` rather than ``tl.sum``; those two are jit functions of Triton's own library), so
  the kernels can be interpreted in a process that imported Triton compiled (see the tests).
* dweight is reduced deterministically: each backward program accumulates ``dy * xhat`` over its
  own fixed block of rows into its own row of a partials buffer; the launcher then sums the
  partials in a fixed order. No atomics.
"""

import os

import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4 reads the variable through its knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Exact conversions by integer arithmetic (interpreter) or by the hardware's instructions (GPU):
# decided when the module is imported, as Triton decides whether to interpret its kernels.
BIT_ARITHMETIC = tl.constexpr(_interpreting())

# ---------------------------------------------------------------------------------------------
# Exact conversions.


@triton.jit
def _bf16_rne_bits(v):
    """fp32 ``v`` -> the bf16 bit pattern (low 16 bits of a uint32), round to nearest even.

    Adding 0x7FFF plus the lowest kept bit carries into the kept half exactly when the dropped half
    is above the halfway point, or at it with an odd kept half; a carry out of the mantissa
    correctly bumps the exponent (max finite rounds to inf). NaN would carry into garbage, so it is
    replaced by the quiet NaN 0x7FC0.
    """
    tl.static_assert(v.dtype == tl.float32, "bf16 rounding is defined from fp32 only")
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit
def _widen(v, CD: tl.constexpr):
    """Loaded values -> compute dtype, exactly (bf16 by bit placement, see the module docstring)."""
    if v.dtype == tl.bfloat16 and BIT_ARITHMETIC:
        out = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(CD)
    else:
        out = v.to(CD)
    return out


@triton.jit
def _narrow(v, DT: tl.constexpr):
    """Compute-dtype values -> storage dtype ``DT``, round to nearest even."""
    if DT == tl.bfloat16 and BIT_ARITHMETIC:
        out = _bf16_rne_bits(v).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DT)
    return out


@triton.jit
def _round_to(v, DT: tl.constexpr, CD: tl.constexpr):
    """``v.to(DT).to(CD)``: the value rounded to ``DT`` but kept in the compute dtype."""
    if DT == tl.bfloat16 and BIT_ARITHMETIC:
        out = (_bf16_rne_bits(v) << 16).to(tl.float32, bitcast=True)
    elif DT == CD:
        out = v
    else:
        out = v.to(DT).to(CD)
    return out


# ---------------------------------------------------------------------------------------------
# Shared row arithmetic.


@triton.jit
def _row_sum(v):
    """Sum of a 1-D block: what ``tl.sum`` does for fp32/fp64 (same combine function, same tree on
    the GPU), but callable from a kernel interpreted in a process whose Triton library was imported
    compiled (``tl.sum`` is itself a jit function; ``tl.reduce`` is a builtin). The interpreter
    recognises this combine function and sums with numpy instead of a sequential Python fold."""
    return tl.reduce(v, 0, tl.standard._sum_combine)


@triton.jit
def _load_s(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr, ROUND_FIRST: tl.constexpr, XDT: tl.constexpr,
            CD: tl.constexpr):
    """The normalised input ``s``: x (+ residual) in the compute dtype, rounded to x's dtype first
    when ROUND_FIRST. Masked-off columns are 0, so they add nothing to the sums."""
    s = _widen(tl.load(x_ptrs, mask=mask, other=0.0), CD)
    if HAS_RESIDUAL:
        s = s + _widen(tl.load(r_ptrs, mask=mask, other=0.0), CD)
        if ROUND_FIRST:
            s = _round_to(s, XDT, CD)
    return s


@triton.jit
def _mean(total, n_cols, CD: tl.constexpr):
    """``total / n`` with IEEE division (``n`` may arrive as the constexpr 1: Triton specialises
    integer arguments equal to 1, hence the float multiply instead of ``.to``). ``n`` is widened
    to the compute dtype: ``n * 1.0`` would be fp32, inexact above 2**24 columns in fp64."""
    n_f = n_cols * tl.full([], 1.0, CD)
    if CD == tl.float32:
        out = tl.math.div_rn(total, n_f)
    else:
        out = total / n_f  # fp64 division is always IEEE-rounded
    return out


@triton.jit
def _rstd(sumsq, n_cols, eps, CD: tl.constexpr):
    """``1 / sqrt(sumsq / n + eps)``, each step IEEE-rounded, as torch's CPU rsqrt computes it."""
    var = _mean(sumsq, n_cols, CD) + tl.full([], eps, CD)
    if CD == tl.float32:
        out = tl.math.div_rn(1.0, tl.math.sqrt_rn(var))
    else:
        out = 1.0 / tl.sqrt(var)  # fp64 sqrt and division are IEEE-rounded
    return out


@triton.jit
def _blocked_rstd(x_row, r_row, cols, n_cols, eps, HAS_RESIDUAL: tl.constexpr, ROUND_FIRST: tl.constexpr,
                  XDT: tl.constexpr, CD: tl.constexpr, BLOCK_N: tl.constexpr):
    """rstd of a row wider than one block: the sum of squares block by block into a vector
    accumulator (one tree reduction at the end, the same for every row)."""
    acc = tl.full([BLOCK_N], 0.0, CD)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        s = _load_s(x_row + c, r_row + c, c < n_cols, HAS_RESIDUAL, ROUND_FIRST, XDT, CD)
        acc += s * s
    return _rstd(_row_sum(acc), n_cols, eps, CD)


@triton.jit
def _scale(xhat, w, DT: tl.constexpr, CAST_HF: tl.constexpr, CD: tl.constexpr):
    """The output: ``(w * xhat).to(DT)``, or with CAST_HF both factors rounded to DT first and the
    product rounded again (Hugging Face's ``weight.to(dtype) * xhat.to(dtype)``)."""
    if CAST_HF:
        y = _round_to(w, DT, CD) * _round_to(xhat, DT, CD)
    else:
        y = w * xhat
    return _narrow(y, DT)


@triton.jit
def _forward_row(X, R, Y, RO, RSTD, row64, stride_x, stride_r, stride_y, stride_ro, cols, mask, w, n_cols, eps,
                 HAS_RESIDUAL: tl.constexpr, HAS_RESIDUAL_OUT: tl.constexpr, ROUND_FIRST: tl.constexpr,
                 CAST_HF: tl.constexpr, STORE_RSTD: tl.constexpr, CD: tl.constexpr):
    """One row of the single-block forward (the kernel's parameters; ``w``: the weight, loaded once
    per program; ``row64``: the row, int64)."""
    s = _load_s(X + row64 * stride_x + cols, R + row64 * stride_r + cols, mask, HAS_RESIDUAL, ROUND_FIRST,
                X.dtype.element_ty, CD)
    if HAS_RESIDUAL_OUT:
        tl.store(RO + row64 * stride_ro + cols, _narrow(s, RO.dtype.element_ty), mask=mask)
    rstd = _rstd(_row_sum(s * s), n_cols, eps, CD)
    if STORE_RSTD:
        tl.store(RSTD + row64, rstd.to(RSTD.dtype.element_ty))
    y = _scale(s * rstd, w, Y.dtype.element_ty, CAST_HF, CD)
    tl.store(Y + row64 * stride_y + cols, y, mask=mask)


# ---------------------------------------------------------------------------------------------
# Forward.


@triton.jit
def rms_norm_fwd_kernel(
    X,  # [rows, n] input (fp32/bf16/fp16/fp64); its dtype is the output dtype and round-first's
    R,  # [rows, n] residual (bf16/fp16/fp32 beside such an x, x's dtype or fp32 beside fp64); any
    # valid pointer when HAS_RESIDUAL is off
    W,  # [n] weight in the compute dtype, contiguous
    Y,  # [rows, n] output in x's dtype; may be X itself (in place)
    RO,  # [rows, n] residual_out (the normalised sum s); may be R itself; unused unless HAS_RESIDUAL_OUT
    RSTD,  # [rows] saved 1/rms for the backward; unused unless STORE_RSTD
    stride_x,  # row strides in elements: rows may be slices of wider rows (no copy is made)
    stride_r,
    stride_y,
    stride_ro,
    n_rows,  # rows in the launch: bounds the last program's row block
    n_cols,  # n, the normalised width; also the mean's divisor
    eps: "fp64",  # as a double so fp64 compute sees the caller's eps; fp32 compute rounds it like torch
    ROWS_PER_PROG: tl.constexpr,  # consecutive rows per program (only amortises per-program setup)
    BLOCK_N: tl.constexpr,  # columns held in registers at once (power of two)
    SINGLE_BLOCK: tl.constexpr,  # n <= BLOCK_N: one pass, weight loaded once per program
    HAS_RESIDUAL: tl.constexpr,  # fused form: s = x + residual
    HAS_RESIDUAL_OUT: tl.constexpr,  # write s (in RO's dtype)
    ROUND_FIRST: tl.constexpr,  # normalise s rounded to x's dtype (vLLM / Liger order)
    CAST_HF: tl.constexpr,  # Hugging Face's output rounding (see _scale)
    STORE_RSTD: tl.constexpr,  # save rstd for the backward (training only)
    CD: tl.constexpr,  # compute dtype: tl.float32, or tl.float64 for fp64 inputs
):
    pid = tl.program_id(0)
    # int64 rows: row * stride can pass 2**31 elements. (The loop variable is then int64 on the GPU;
    # the interpreter hands out Python ints, so nothing calls methods on it.)
    row_begin = pid.to(tl.int64) * ROWS_PER_PROG
    row_end = tl.minimum(row_begin + ROWS_PER_PROG, n_rows)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(CD)
        if ROWS_PER_PROG == 1:
            # One row a program (every launch up to FWD_MAX_PROGRAMS rows) as straight-line code.
            # Inside the row loop (trip count <= 1) the compiler issued the weight's loads only after
            # the row's sum of squares (sm_90 SASS, fused bf16 [1, 7168]): at decode their latency
            # then followed x's instead of overlapping it. Here all of a row's loads go out first.
            _forward_row(X, R, Y, RO, RSTD, row_begin, stride_x, stride_r, stride_y, stride_ro, cols, mask, w,
                         n_cols, eps, HAS_RESIDUAL, HAS_RESIDUAL_OUT, ROUND_FIRST, CAST_HF, STORE_RSTD, CD)
        else:
            for row64 in range(row_begin, row_end):
                _forward_row(X, R, Y, RO, RSTD, row64, stride_x, stride_r, stride_y, stride_ro, cols, mask, w,
                             n_cols, eps, HAS_RESIDUAL, HAS_RESIDUAL_OUT, ROUND_FIRST, CAST_HF, STORE_RSTD, CD)
    else:
        for row64 in range(row_begin, row_end):
            x_row = X + row64 * stride_x
            r_row = R + row64 * stride_r
            rstd = _blocked_rstd(x_row, r_row, cols, n_cols, eps, HAS_RESIDUAL, ROUND_FIRST, X.dtype.element_ty, CD,
                                 BLOCK_N)
            if STORE_RSTD:
                tl.store(RSTD + row64, rstd.to(RSTD.dtype.element_ty))
            # Pass 2: recompute s from the inputs (not from RO, which may alias R and holds s only
            # rounded), then write residual_out and y block by block.
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                m = c < n_cols
                s = _load_s(x_row + c, r_row + c, m, HAS_RESIDUAL, ROUND_FIRST, X.dtype.element_ty, CD)
                if HAS_RESIDUAL_OUT:
                    tl.store(RO + row64 * stride_ro + c, _narrow(s, RO.dtype.element_ty), mask=m)
                w = tl.load(W + c, mask=m, other=0.0).to(CD)
                y = _scale(s * rstd, w, Y.dtype.element_ty, CAST_HF, CD)
                tl.store(Y + row64 * stride_y + c, y, mask=m)


# ---------------------------------------------------------------------------------------------
# Backward.


@triton.jit
def rms_norm_bwd_kernel(
    DY,  # [rows, n] gradient of y, in x's dtype
    X,  # [rows, n] forward input: s is recomputed rather than saved (saves a [rows, n] buffer)
    R,  # [rows, n] forward residual; any valid pointer when HAS_RESIDUAL is off
    W,  # [n] weight in the compute dtype
    RSTD,  # [rows] rstd saved by the forward (compute dtype)
    DRO,  # [rows, n] gradient flowing into residual_out; unused unless HAS_DRO
    DX,  # [rows, n] out: gradient of x, in x's dtype (may alias DY)
    DR,  # [rows, n] out: gradient of residual, in residual's dtype; unused unless HAS_DR
    DW_PARTIAL,  # [programs, n] out, compute dtype: this program's sum of dy * xhat over its rows;
    # must be zeroed by the launcher when SINGLE_BLOCK is off (accumulated block by block then)
    stride_dy,  # row strides in elements
    stride_x,
    stride_r,
    stride_dro,
    stride_dx,
    stride_dr,
    n_rows,  # rows in the launch
    n_cols,  # n
    ROWS_PER_PROG: tl.constexpr,  # the fixed row block each program reduces dweight over
    BLOCK_N: tl.constexpr,  # columns held in registers at once (power of two)
    SINGLE_BLOCK: tl.constexpr,  # n <= BLOCK_N: one pass per row, dweight partial in registers
    HAS_RESIDUAL: tl.constexpr,  # the forward was the fused form
    HAS_DRO: tl.constexpr,  # residual_out received a gradient: ds += d residual_out
    HAS_DR: tl.constexpr,  # write DR; off where the caller hands DX to both inputs (the gradient of
    # x + residual is one tensor: along a chain of fused norms), one [rows, n] stream less
    ROUND_FIRST: tl.constexpr,  # the forward normalised s rounded to x's dtype
    PREFETCH: tl.constexpr,  # single block: load the next row's x, residual, dy before this row's
    # reduction, so that a program (one or two resident per SM at these widths) keeps loads in flight
    NUM_STAGES: tl.constexpr,  # single block: Triton's software pipelining of the row loop (1: off).
    # From 2 up, the loads of the next NUM_STAGES - 1 iterations (rows, or with PREFETCH the rows
    # after those) are issued early as asynchronous copies into shared memory (cp.async on sm_80+),
    # so rows in flight cost shared memory, not registers
    CD: tl.constexpr,  # compute dtype
):
    pid = tl.program_id(0)
    # int64 rows: row * stride can pass 2**31 elements. (The loop variable is then int64 on the GPU;
    # the interpreter hands out Python ints, so nothing calls methods on it.)
    row_begin = pid.to(tl.int64) * ROWS_PER_PROG
    row_end = tl.minimum(row_begin + ROWS_PER_PROG, n_rows)
    cols = tl.arange(0, BLOCK_N)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols
    if SINGLE_BLOCK:
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(CD)
        dw = tl.full([BLOCK_N], 0.0, CD)
        if PREFETCH:  # the first row's inputs; each iteration then loads the next row's
            s_next = _load_s(X + row_begin * stride_x + cols, R + row_begin * stride_r + cols, mask, HAS_RESIDUAL,
                             ROUND_FIRST, X.dtype.element_ty, CD)
            dy_next = _widen(tl.load(DY + row_begin * stride_dy + cols, mask=mask, other=0.0), CD)
        # Pipelining reorders only when loads are issued: each row's arithmetic is unchanged.
        for row64 in tl.range(row_begin, row_end, num_stages=NUM_STAGES):
            if PREFETCH:
                s = s_next
                dy = dy_next
                # Past the program's last row the loads are masked off (nothing is read).
                more = cols < tl.where(row64 + 1 < row_end, n_cols, 0)
                s_next = _load_s(X + (row64 + 1) * stride_x + cols, R + (row64 + 1) * stride_r + cols, more,
                                 HAS_RESIDUAL, ROUND_FIRST, X.dtype.element_ty, CD)
                dy_next = _widen(tl.load(DY + (row64 + 1) * stride_dy + cols, mask=more, other=0.0), CD)
            else:
                s = _load_s(X + row64 * stride_x + cols, R + row64 * stride_r + cols, mask, HAS_RESIDUAL,
                            ROUND_FIRST, X.dtype.element_ty, CD)
                dy = _widen(tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0), CD)
            rstd = tl.load(RSTD + row64).to(CD)
            xhat = s * rstd
            g = dy * w
            ds = rstd * (g - xhat * _mean(_row_sum(g * xhat), n_cols, CD))
            if HAS_DRO:
                ds += _widen(tl.load(DRO + row64 * stride_dro + cols, mask=mask, other=0.0), CD)
            tl.store(DX + row64 * stride_dx + cols, _narrow(ds, DX.dtype.element_ty), mask=mask)
            if HAS_DR:
                tl.store(DR + row64 * stride_dr + cols, _narrow(ds, DR.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(dw_row + cols, dw, mask=mask)
    else:
        for row64 in range(row_begin, row_end):
            x_row = X + row64 * stride_x
            r_row = R + row64 * stride_r
            dy_row = DY + row64 * stride_dy
            rstd = tl.load(RSTD + row64).to(CD)
            # Pass 1: mean(g * xhat) over the whole row.
            acc = tl.full([BLOCK_N], 0.0, CD)
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                m = c < n_cols
                s = _load_s(x_row + c, r_row + c, m, HAS_RESIDUAL, ROUND_FIRST, X.dtype.element_ty, CD)
                dy = _widen(tl.load(dy_row + c, mask=m, other=0.0), CD)
                w = tl.load(W + c, mask=m, other=0.0).to(CD)
                acc += (dy * w) * (s * rstd)
            proj = _mean(_row_sum(acc), n_cols, CD)
            # Pass 2: the gradients, and this program's dweight partial updated in place.
            for start in range(0, n_cols, BLOCK_N):
                c = start + cols
                m = c < n_cols
                s = _load_s(x_row + c, r_row + c, m, HAS_RESIDUAL, ROUND_FIRST, X.dtype.element_ty, CD)
                dy = _widen(tl.load(dy_row + c, mask=m, other=0.0), CD)
                w = tl.load(W + c, mask=m, other=0.0).to(CD)
                xhat = s * rstd
                ds = rstd * (dy * w - xhat * proj)
                if HAS_DRO:
                    ds += _widen(tl.load(DRO + row64 * stride_dro + c, mask=m, other=0.0), CD)
                tl.store(DX + row64 * stride_dx + c, _narrow(ds, DX.dtype.element_ty), mask=m)
                if HAS_DR:
                    tl.store(DR + row64 * stride_dr + c, _narrow(ds, DR.dtype.element_ty), mask=m)
                partial = tl.load(dw_row + c, mask=m, other=0.0)
                tl.store(dw_row + c, partial + dy * xhat, mask=m)
            # The next row re-reads this row's partial stores, possibly from other threads of the
            # program: a block-wide barrier also orders the global writes before those reads.
            tl.debug_barrier()
