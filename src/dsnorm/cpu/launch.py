"""Launchers: from tensors to kernel calls, for the core forms (:func:`forward`, :func:`backward`)
and the fusions (:func:`rms_norm_fp8`, :func:`final_norm_lengths`, :func:`mla_latent_norms`); the
interface of :mod:`dsnorm.triton.launch` and :mod:`dsnorm.triton.fusions`, with :func:`empty_output`
(:mod:`dsnorm.cpu.alloc`) for the outputs.

A launcher takes rows its caller validated (dsnorm.ops, dsnorm.fusions: unit stride along the row,
leading dims that collapse to one row stride), picks the serial kernel or a parallel launch on
numba's pool (small inputs run on the calling thread: a launch costs more than their work), takes
its thread's scratch, and passes addresses, strides and dtype codes. Once a kernel is compiled, the
hot launchers call its compiled entry point directly: the dispatcher's type resolution of some
twenty arguments costs a good part of a decode-sized call.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import types

from dsnorm.cpu.alloc import empty_output  # noqa: F401 (the launchers' interface: dsnorm.ops, dsnorm.fusions)
from dsnorm.cpu.cascade import ACC_SLOTS
from dsnorm.cpu.fusion_kernels import (
    FINAL_ROWS_SIGNATURES,
    FP8_ROWS_SIGNATURES,
    MLA_ROWS_SIGNATURES,
    final_parallel,
    final_rows,
    final_serial,
    fp8_parallel,
    fp8_rows,
    fp8_serial,
    mla_parallel,
    mla_rows,
    mla_serial,
)
from dsnorm.cpu.intrinsics import DTYPE_CODES, F32, F64
from dsnorm.cpu.kernels import (
    BACKWARD_SHARE_SIGNATURES,
    FORWARD_ROWS_SIGNATURES,
    backward_kernel,
    backward_serial,
    backward_share,
    forward_parallel,
    forward_rows,
    forward_serial32,
    forward_serial64,
)
from dsnorm.cpu.runtime import SERIAL_NUMEL, compiling, on_pool, run, threads_for
from dsnorm.rows import row_stride

# Each Python thread's scratch, kept between its calls (_scratch, _row_scratch).
_local = threading.local()


# The serial kernels' compiled entry points, once compiled: calling an entry point directly skips
# the dispatcher's type resolution. Their argument types never vary (Python ints, a float, bools),
# so each has exactly one specialisation.
_serial_entry: dict = {}


def _serial(x64: bool):
    entry = _serial_entry.get(x64)
    if entry is None:
        kernel = forward_serial64 if x64 else forward_serial32

        def entry(*args):
            run(kernel, None, *args)
            if len(kernel.overloads) == 1:
                _serial_entry[x64] = next(iter(kernel.overloads.values())).entry_point

    return entry


_PAGE = 4096


def thread_rows(nthreads: int, width: int, dtype) -> np.ndarray:
    """``[nthreads, >= width]`` scratch, one row per thread, rows at least a page apart.

    Adjacent rows made two threads share cache lines (and prefetched each other's lines, which
    never cross a page): with one thread writing its accumulators at the end of its row and the
    next writing the start of its own, the lines bounced between the cores.
    """
    itemsize = np.dtype(dtype).itemsize
    row_bytes = -(-width * itemsize // _PAGE) * _PAGE + _PAGE
    return np.empty((nthreads, row_bytes // itemsize), dtype=dtype)


def _entry_point(kernel, arg: int, dtype):
    """The compiled entry point of ``kernel``'s specialisation whose argument ``arg`` is an array of
    ``dtype`` (the kernels below are specialised only by their scratch's dtype), or None."""
    for sig, overload in kernel.overloads.items():
        if sig[arg].dtype == numba.from_dtype(dtype):
            return overload.entry_point
    return None


def _first_run(kernel, entries: dict, x64: bool, scratch_arg: int, *args) -> None:
    """A kernel's first call per compute dtype (``run``: it compiles), its compiled entry point
    then recorded in ``entries[x64]`` for the callers to call directly; for the kernels specialised
    only by their scratch's dtype (argument ``scratch_arg``)."""
    run(kernel, x64, *args)
    entries[x64] = _entry_point(kernel, scratch_arg, args[scratch_arg].dtype)


def compiled_address(kernel, signature: tuple) -> int:
    """The machine-code address of ``kernel`` compiled for the argument types ``signature``, for a
    call by address (``by_address``): compiled, or loaded from numba's cache, under
    :func:`~dsnorm.cpu.runtime.compiling` as in :func:`~dsnorm.cpu.runtime.run`. Not to be called
    while the compile lock is held."""
    with compiling():
        kernel.compile(signature)
    overload = kernel.overloads[signature]
    if overload.signature.return_type != types.none:
        # The call is emitted with a None return slot: a wider return value would overrun it.
        raise TypeError(f"{kernel.py_func.__name__} returns {overload.signature.return_type}; a call by address "
                        "takes kernels that return None")
    address = overload.library.get_pointer_to_function(overload.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"numba's engine has no machine code for {kernel.py_func.__name__}{signature}")
    return address


class Parallel:
    """A parallel kernel whose first argument is the address of the rows kernel it calls on each
    thread (``by_address``), launched on the pool.

    ``kernel``'s specialisations differ only in their scratch's dtype (the kernel's argument
    ``scratch_arg``, the address being argument 0); ``rows_signatures[key]`` is the rows kernel's
    signature for a launch's ``key`` (the compute dtype, x64, or None where there is one), whose
    scratch has the same dtype (checked on the first launch of a key; callers derive the key and
    the scratch from one dtype). Once compiled for a key, launches call the compiled entry point
    with the address directly, past the dispatcher's type resolution of some twenty arguments and
    the hashing of a dispatcher for ``run``'s lookup.
    """

    def __init__(self, kernel, rows_kernel, rows_signatures: dict, scratch_arg: int):
        self.kernel = kernel
        self.rows_kernel = rows_kernel
        self.rows_signatures = rows_signatures
        self.scratch_arg = scratch_arg
        # key -> (entry point, rows kernel address) once compiled; hot launchers read it directly.
        self.ready: dict = {}

    def launch(self, key, *args) -> None:
        """``kernel(rows kernel's address, *args)`` on the pool (compiled on first use); ``args``:
        the kernel's arguments after the address."""
        ready = self.ready.get(key)
        if ready is not None:
            on_pool(ready[0], ready[1], *args)
            return
        signature = self.rows_signatures[key]
        scratch = args[self.scratch_arg - 1]
        want = next(t.dtype for t in signature if isinstance(t, types.Array))
        if numba.from_dtype(scratch.dtype) != want:  # the address would be another compilation's
            raise TypeError(f"{self.kernel.py_func.__name__}: a {scratch.dtype} scratch for key {key!r}, whose rows "
                            f"kernel takes {want}")
        address = compiled_address(self.rows_kernel, signature)
        on_pool(run, self.kernel, key, address, *args)
        entry = _entry_point(self.kernel, self.scratch_arg, scratch.dtype)
        if entry is not None:
            self.ready[key] = (entry, address)


def run_either(nthreads: int, serial, parallel: Parallel, key, *args) -> None:
    """``serial(*args)`` on this thread when ``nthreads == 1`` (through :func:`run`: compiled on
    first use), else ``parallel.launch(key, *args)`` on the pool."""
    if nthreads == 1:
        run(serial, key, *args)
    else:
        parallel.launch(key, *args)


_FORWARD_PARALLEL = Parallel(forward_parallel, forward_rows, FORWARD_ROWS_SIGNATURES, 3)
_BACKWARD_PARALLEL = Parallel(backward_kernel, backward_share, BACKWARD_SHARE_SIGNATURES, 4)
# _FORWARD_PARALLEL's compiled (entry point, address) by x64, read here without the method call.
_forward_ready = _FORWARD_PARALLEL.ready


def run_parallel(x64: bool, nthreads: int, rows: int, n: int, *args) -> None:
    """``forward_parallel`` on ``nthreads`` threads with this thread's scratch (args: the
    kernel's arguments after ``scratch``)."""
    scratch = _rows_scratch(nthreads, n, np.float64 if x64 else np.float32)
    ready = _forward_ready.get(x64)
    if ready is None:
        _FORWARD_PARALLEL.launch(x64, rows, n, scratch, *args)
    else:
        on_pool(ready[0], ready[1], rows, n, scratch, *args)


def _rows_scratch(nthreads: int, n: int, dtype) -> np.ndarray:
    """This Python thread's scratch for ``forward_rows`` on rows of ``n`` values: the row, its
    accumulators and room for a narrow gain widened past them (kernels.thread_gain). One width for
    every forward launcher, so that core and fused calls, fp32 and bf16 gains, keep one scratch."""
    return _scratch(nthreads, 2 * n + ACC_SLOTS, dtype)


def _scratch(nthreads: int, width: int, dtype, slot: str = "scratch") -> np.ndarray:
    """This Python thread's ``thread_rows`` scratch, kept between calls of one shape. ``slot``: the
    backward keeps its own (another width), so that a parallel forward and the backward of one
    training step do not evict each other's."""
    key = (nthreads, width, dtype)
    cache = getattr(_local, slot, None)
    if cache is None or cache[0] != key:
        cache = (key, thread_rows(nthreads, width, dtype))
        setattr(_local, slot, cache)
    return cache[1]


def _addr(t):
    return 0 if t is None else t.data_ptr()


def _stride(t):
    return 0 if t is None else row_stride(t)


def _code(t, default=F32):
    return default if t is None else DTYPE_CODES[t.dtype]


def forward(x, residual, weight, eps, cast_hf, round_first, y, residual_out, rstd) -> None:
    """y = weight * s * rsqrt(mean(s^2) + eps), s = x (+ residual); residual_out = s; rstd saved.

    x, y: ``[..., n]`` with unit stride along the row and leading dims that collapse to one row
    stride (y may be x); residual, residual_out: the same or None (residual_out may be residual);
    weight: [n] in the compute dtype (fp64 for fp64 x, else fp32); rstd: [rows] contiguous in the
    compute dtype, or None.
    """
    # Every line here runs on every call: at decode sizes this function costs as much as the
    # kernel, so it reads each attribute once and calls no helpers in the common case.
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return
    x_code = DTYPE_CODES[x.dtype]
    x64 = x_code == F64
    if residual is None:
        r_addr = r_stride = r_code = 0
    else:
        r_addr = residual.data_ptr()
        r_stride = n if residual.is_contiguous() else row_stride(residual)
        r_code = DTYPE_CODES[residual.dtype]
    if residual_out is None:
        o_addr = o_stride = o_code = 0
    else:
        o_addr = residual_out.data_ptr()
        o_stride = n if residual_out.is_contiguous() else row_stride(residual_out)
        o_code = DTYPE_CODES[residual_out.dtype]
    x_addr, x_stride = x.data_ptr(), n if x.is_contiguous() else row_stride(x)
    w_addr, y_addr, y_stride = weight.data_ptr(), y.data_ptr(), n if y.is_contiguous() else row_stride(y)
    rest = (o_addr, o_stride, o_code, 0 if rstd is None else rstd.data_ptr(), float(eps), cast_hf, round_first)
    rows = numel // n
    nthreads = 1 if numel < SERIAL_NUMEL else min(threads_for(numel), rows)
    if nthreads == 1:
        (_serial_entry.get(x64) or _serial(x64))(rows, n, x_addr, x_stride, x_code, r_addr, r_stride, r_code,
                                                  w_addr, y_addr, y_stride, *rest)
    else:  # the parallel kernel also takes the gain's dtype: the weight is in the compute dtype here
        run_parallel(x64, nthreads, rows, n, x_addr, x_stride, x_code, r_addr, r_stride, r_code,
                     w_addr, F64 if x64 else F32, y_addr, y_stride, *rest)


def dweight_block_rows(rows: int) -> int:
    """Rows per dweight partial: a function of the row count only (never of the thread count)."""
    return max(16, -(-rows // 256))


# Small backwards run on the calling thread: two threads pay off only once the serial kernel takes
# about twice a pool launch, about when rows * (n + BWD_ROW_COST) reaches BWD_SERIAL_WORK (a row's
# own work, its reductions and loads, costs about as much as 128 more elements).
BWD_ROW_COST = 128
BWD_SERIAL_WORK = 1 << 15
# The serial backward's compiled entry points by compute dtype (as _serial_entry: skips the
# dispatcher's type resolution of its two arrays and 22 scalars).
_backward_entry: dict = {}


def backward(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, dweight) -> None:
    """Gradients of ``forward``: dx (x.dtype), dresidual (residual's dtype; None: not written, the
    caller's dx serves both), dweight ([n] contiguous in the compute dtype, written).

    ds = rstd * (g - xhat * mean(g * xhat)) + dresidual_out, g = dy * weight, xhat = s * rstd;
    dweight = sum over rows of dy * xhat, reduced over fixed row blocks in block order.
    """
    n = x.shape[-1]
    numel = x.numel()
    rows = numel // n
    if rows == 0:
        dweight.zero_()
        return
    x64 = x.dtype == torch.float64
    np_cdtype = np.float64 if x64 else np.float32
    block_rows = dweight_block_rows(rows)
    nblocks = -(-rows // block_rows)
    small = rows * (n + BWD_ROW_COST) < BWD_SERIAL_WORK
    nthreads = 1 if nblocks == 1 or small else min(threads_for(max(numel, SERIAL_NUMEL)), nblocks)
    scratch = _scratch(nthreads, 2 * n, np_cdtype, "backward_scratch")
    partials = np.empty((nblocks, n), dtype=np_cdtype)
    args = (
        rows, n, block_rows, scratch, partials, dweight.data_ptr(),
        dy.data_ptr(), row_stride(dy), x.data_ptr(), row_stride(x), DTYPE_CODES[x.dtype],
        _addr(residual), _stride(residual), _code(residual),
        weight.data_ptr(), rstd.data_ptr(),
        _addr(dresidual_out), _stride(dresidual_out), _code(dresidual_out),
        dx.data_ptr(), row_stride(dx), _addr(dresidual), _stride(dresidual), bool(round_first),
    )
    if nthreads > 1:
        _BACKWARD_PARALLEL.launch(x64, *args)
        return
    entry = _backward_entry.get(x64)
    if entry is None:
        _first_run(backward_serial, _backward_entry, x64, 3, *args)
    else:
        entry(*args)


# ---------------------------------------------------------------------------------------------
# Norm + fp8.


_FP8_PARALLEL = Parallel(fp8_parallel, fp8_rows, FP8_ROWS_SIGNATURES, 3)


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
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(threads_for(numel), rows))
    scratch = _rows_scratch(nthreads, n, np.float32)
    row_bytes = -(-n * x.element_size() // 64) * 64  # whole cache lines
    ytmp = _row_scratch(nthreads, row_bytes)
    run_either(
        nthreads, fp8_serial, _FP8_PARALLEL, None,
        rows, n, scratch, ytmp.ctypes.data, ytmp.shape[1],
        x.data_ptr(), row_stride(x), DTYPE_CODES[x.dtype],
        0 if residual is None else residual.data_ptr(), 0 if residual is None else row_stride(residual),
        weight.data_ptr(), 0 if y is None else y.data_ptr(), 0 if y is None else n,
        0 if residual_out is None else residual_out.data_ptr(), 0 if residual_out is None else n,
        float(eps), int(block), bool(ue8m0), q.data_ptr(), scales.data_ptr(),
    )


# ---------------------------------------------------------------------------------------------
# Final norm at each row's last valid position.


_FINAL_PARALLEL = Parallel(final_parallel, final_rows, FINAL_ROWS_SIGNATURES, 3)


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
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(threads_for(numel), rows))
    scratch = _rows_scratch(nthreads, n, np.float64 if h.dtype == torch.float64 else np.float32)
    run_either(
        nthreads, final_serial, _FINAL_PARALLEL, h.dtype == torch.float64,
        rows, n, scratch, lengths.data_ptr(), h.element_size(),
        h.data_ptr(), h.stride(0), h.stride(1), DTYPE_CODES[h.dtype],
        residual.data_ptr(), residual.stride(0), residual.stride(1),
        weight.data_ptr(), y.data_ptr(), residual_out.data_ptr(), float(eps),
    )


# ---------------------------------------------------------------------------------------------
# MLA latents: q_norm and kv_norm in one kernel.


_MLA_PARALLEL = Parallel(mla_parallel, mla_rows, MLA_ROWS_SIGNATURES, 2)


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
    nthreads = 1 if numel < SERIAL_NUMEL else max(1, min(threads_for(numel), rows))
    x64 = q_latent.dtype == torch.float64
    scratch = _rows_scratch(nthreads, max(nq, nkv), np.float64 if x64 else np.float32)
    run_either(
        nthreads, mla_serial, _MLA_PARALLEL, x64,
        rows, scratch, DTYPE_CODES[q_latent.dtype], float(eps),
        nq, q_latent.data_ptr(), row_stride(q_latent), q_weight.data_ptr(), q_out.data_ptr(),
        nkv, kv.data_ptr(), row_stride(kv), kv_weight.data_ptr(), kv_out.data_ptr(),
    )
