"""The fast lanes: the first thing the ops' CPU implementations, the public functions and the module
try (:func:`lane`; :func:`mla_lane` for the MLA pair), and the decode kernel's entry point they call.

A lane proves, in one attribute pass, what the general path would establish step by step: no
gradient to record, no compile/functorch/mode/tracing in effect (so the op's implementation is what
the dispatcher would run), tensor types, dtypes, shapes, devices, an fp32 weight (or a bf16/fp16
one the functions widen) and valid options; then it allocates and calls the kernel. It only
*recognises*: anything else (a bad argument included) returns None and goes the general way, where
every error is raised. A decode norm is then one attribute pass, one allocation and the kernel,
called through its compiled entry point: at decode sizes the dispatcher's type resolution costs
about as much as the kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from dsnorm.cpu.alloc import PRIME_MIN_BYTES, empty_output
from dsnorm.cpu.intrinsics import BF16, F16, F32
from dsnorm.cpu.kernels import decode32
from dsnorm.cpu.launch import forward, run_parallel
from dsnorm.cpu.runtime import SERIAL_NUMEL, run, threads_for
from dsnorm.dispatch import PLAIN_TYPES as _PLAIN_TYPES
from dsnorm.dispatch import dispatch_free
from dsnorm.rows import row_stride, rows_viewable
from dsnorm.spec import CAST_HF as _CASTS_HF
from dsnorm.spec import EPS_MAX as _EPS_MAX
from dsnorm.spec import EPS_MIN as _EPS_MIN
from dsnorm.spec import ROUND_FIRST as _ROUNDINGS_FIRST
from dsnorm.spec import WIDENED_RESIDUALS as _WIDENED_RESIDUALS
from dsnorm.spec import Form

_DECODE_CODES = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}
_NARROW_GAINS = {torch.bfloat16: BF16, torch.float16: F16}
_F32 = torch.float32
_decode_entry = None


def _compile_decode():
    """Compile (or load) the decode kernel once, then keep (and return) its entry point."""
    global _decode_entry
    x = np.zeros(1, dtype=np.float32)
    w = np.ones(1, dtype=np.float32)
    run(decode32, None, 1, 1, F32, x.ctypes.data, 1, 0, w.ctypes.data, F32, x.ctypes.data, 0, 1e-6, False, False)
    _decode_entry = next(iter(decode32.overloads.values())).entry_point
    return _decode_entry


_is_grad_enabled = torch.is_grad_enabled
_inference_mode_enabled = torch.is_inference_mode_enabled
_STRIDED = torch.strided
_TENSOR, _PARAMETER = _PLAIN_TYPES
PLAIN, FUSED, INPLACE = Form.PLAIN, Form.FUSED, Form.INPLACE


def lane(form, x, residual, weight, eps, cast, residual_rounding, residual_dtype, narrow_weight=False):
    """The result of a call that needs only the kernel, or None (then the general path runs).

    ``form`` (a :class:`dsnorm.spec.Form`) is PLAIN (returns ``y``; residual and its options are
    ignored), FUSED (``(y, residual_out)``) or INPLACE (``(x, residual)``, written; a caller that
    bypasses the dispatcher bumps their version counters, as the dispatcher would). Accepted: plain
    CPU tensors of one dtype (bf16/fp16/fp32; FUSED also takes a residual of another of them, and
    ``residual_dtype=torch.float32``), an fp32 weight (or, with ``narrow_weight``, which the
    functions and the module pass as they widen a bf16/fp16 gain exactly and the ops refuse one, a
    bf16/fp16 weight, widened the same way), valid options; contiguous rows, or outside
    INPLACE rows of x with one stride between them (the kv_norm slice). Calls below the serial
    size go straight to the decode kernel's entry point and larger ones to its threaded form,
    except FUSED calls with strided x or mixed dtypes, which go to ``forward``. Nothing is taken
    while autograd, torch.compile, torch.jit tracing, functorch, a dispatch/function mode or the
    profiler is in effect, nor for a tensor with the negative bit (a lazily negated view,
    ``x.conj().imag``) or a ZeroTensor (no memory; a slice of one has a made-up nonzero address):
    the dispatcher resolves them, a raw pointer would not; nor, in place, for an inference tensor
    outside inference mode (which torch does not let be written). The rules are
    :mod:`dsnorm.spec`'s (its tables: eps bounds, options, residual dtypes), written out in one
    function, cheapest refusals and the reads every call needs first: tensor attributes and Python
    calls are most of a decode norm's cost.
    """
    tx = type(x)
    tw = type(weight)
    if (tx is not _TENSOR and tx is not _PARAMETER) or (tw is not _TENSOR and tw is not _PARAMETER):
        return None
    grad = _is_grad_enabled()
    if grad and (x.requires_grad or weight.requires_grad):
        return None
    if not dispatch_free():
        return None
    dtype = x.dtype
    code = _DECODE_CODES.get(dtype)
    if code is None or type(eps) is not float or not _EPS_MIN <= eps <= _EPS_MAX:
        return None
    w_code = F32
    if weight.dtype is not _F32:
        w_code = _NARROW_GAINS.get(weight.dtype) if narrow_weight else None
        if w_code is None:
            return None
    cast_hf = _CASTS_HF.get(cast) if type(cast) is str else None
    if cast_hf is None or not (x.is_cpu and weight.is_cpu) or x.layout is not _STRIDED:
        return None
    try:  # free unless it raises (a nested x has no shape): then the general path names the problem
        if x.is_neg() or weight.is_neg() or x._is_zerotensor() or weight._is_zerotensor():
            return None
        if not weight.is_contiguous() or weight.ndim != 1:
            return None
        shape = x.shape
        n = weight.numel()
        if not shape or shape[-1] != n:
            return None
        numel = x.numel()
        contiguous = x.is_contiguous()
        if numel == 0 or (not contiguous and (form == INPLACE or not rows_viewable(x))):
            return None
        x_addr = x.data_ptr()
        w_addr = weight.data_ptr()  # raises for a weight of another layout
    except RuntimeError:
        return None
    small = numel < SERIAL_NUMEL
    nbytes = numel * (4 if code == F32 else 2)
    # Outputs below the heap primer's size need none of empty_output's care.
    plain_alloc = nbytes < PRIME_MIN_BYTES
    if form == PLAIN:
        if plain_alloc:
            y = torch.empty_like(x) if contiguous else torch.empty(shape, dtype=dtype)
        else:
            y = empty_output(x, dtype)
        launch = _decode_entry or _compile_decode() if small else _lane_parallel
        stride = n if contiguous else row_stride(x)
        launch(numel // n, n, code, x_addr, stride, 0, w_addr, w_code, y.data_ptr(), 0, eps, cast_hf, False)
        return y
    # The residual: x's shape, contiguous, on the CPU; x's dtype, or in the out-of-place form any
    # of the widened ones (an fp32 stream beside a bf16 x). Every refusal takes the general path,
    # which names the problem.
    tr = type(residual)
    if tr is not _TENSOR and tr is not _PARAMETER:
        return None
    r_dtype = residual.dtype
    if r_dtype is not dtype and (form == INPLACE or r_dtype not in _WIDENED_RESIDUALS):
        return None
    if grad and residual.requires_grad:
        return None
    try:  # a residual of another layout raises in one of these (then the general path names it)
        if residual.shape != shape or not residual.is_contiguous() or not residual.is_cpu:
            return None
        if residual.is_neg() or residual._is_zerotensor():
            return None
        r_addr = residual.data_ptr()
    except RuntimeError:
        return None
    round_first = _ROUNDINGS_FIRST.get(residual_rounding) if type(residual_rounding) is str else None
    if round_first is None or (residual_dtype is not None and (residual_dtype is not _F32 or round_first)):
        return None
    if form == INPLACE and residual_dtype is not None and dtype is not _F32:
        return None  # in place the buffer's dtype decides: the general path names a narrower one
    launch = _decode_entry or _compile_decode() if small else _lane_parallel
    if form == FUSED:
        out_dtype = dtype if residual_dtype is None else residual_dtype
        if plain_alloc:
            if contiguous:  # empty_like: the general path's strides, size-1 dimensions' included
                y, residual_out = torch.empty_like(x), torch.empty_like(x, dtype=out_dtype)
            else:
                y, residual_out = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=out_dtype)
        else:
            y = empty_output(x, dtype)
            residual_out = empty_output(x, out_dtype)
        if not (contiguous and r_dtype is dtype and out_dtype is dtype):
            # Strided rows of x, or dtypes that differ (an fp32 residual stream): the kernels that
            # take a stride and a dtype per tensor, still well short of the general path at decode.
            forward(x, residual, weight if w_code == F32 else weight.float(), eps, cast_hf, round_first, y,
                    residual_out, None)
        else:
            launch(numel // n, n, code, x_addr, n, r_addr, w_addr, w_code, y.data_ptr(), residual_out.data_ptr(),
                   eps, cast_hf, round_first)
        return y, residual_out
    # The weight is read while x and residual are written (a narrow one too: each thread of a
    # threaded call widens it when it starts, while another may be writing its rows): apart from both.
    w_end = w_addr + (4 if w_code == F32 else 2) * n
    if not ((x_addr + nbytes <= r_addr or r_addr + nbytes <= x_addr)
            and (w_end <= x_addr or x_addr + nbytes <= w_addr) and (w_end <= r_addr or r_addr + nbytes <= w_addr)):
        return None
    if not _inference_mode_enabled() and (x.is_inference() or residual.is_inference()):
        return None  # torch writes an inference tensor only in inference mode: the general path says so
    launch(numel // n, n, code, x_addr, n, r_addr, w_addr, w_code, x_addr, r_addr, eps, cast_hf, round_first)
    return x, residual


def _lane_parallel(rows, n, code, x_addr, x_stride, res_addr, w_addr, w_code, y_addr, rout_addr, eps, cast_hf,
                   round_first):
    """The decode kernel's arguments, run on the thread pool (fp32 compute, contiguous outputs)."""
    nthreads = min(threads_for(rows * n), rows)
    if nthreads == 1:
        (_decode_entry or _compile_decode())(
            rows, n, code, x_addr, x_stride, res_addr, w_addr, w_code, y_addr, rout_addr, eps, cast_hf, round_first
        )
        return
    # A narrow gain is widened by each thread into its own scratch (kernels.thread_gain).
    run_parallel(False, nthreads, rows, n, x_addr, x_stride, code, res_addr, n, code, w_addr, w_code, y_addr, n,
                 rout_addr, n, code, 0, eps, cast_hf, round_first)


# The lane takes decode batches (64 rows of 1536 and more); prefill-sized calls take the general
# path, one launch for both norms on the thread pool.
_MLA_LANE_NUMEL = 1 << 17


def mla_lane(q_latent, kv_a, q_weight, kv_weight, eps, cast):
    """``(q_out, kv_out)`` of a decode-sized call that needs only the kernel, or None (then the
    general, checked path runs).

    :func:`lane` for the MLA pair: plain CPU tensors of one dtype (bf16/fp16/fp32),
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
    if _is_grad_enabled() and (q_latent.requires_grad or kv_a.requires_grad or q_weight.requires_grad
                                   or kv_weight.requires_grad):
        return None
    if not dispatch_free():
        return None
    dtype = q_latent.dtype
    code = _DECODE_CODES.get(dtype)
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
    q_out = torch.empty_like(q_latent) if q_bytes < PRIME_MIN_BYTES else empty_output(q_latent, dtype)
    kv_out = torch.empty(*kv_shape[:-1], nkv, dtype=dtype)
    # Each norm as the core lane runs it: the decode kernel on this thread, the pool past the serial size.
    entry = _decode_entry or _compile_decode()
    launch = entry if numel < SERIAL_NUMEL else _lane_parallel
    launch(rows, nq, code, addrs[0], nq, 0, addrs[2], F32, q_out.data_ptr(), 0, eps, False, False)
    launch = entry if rows * nkv < SERIAL_NUMEL else _lane_parallel
    launch(rows, nkv, code, addrs[1], kv_width, 0, addrs[3], F32, kv_out.data_ptr(), 0, eps, False, False)
    return q_out, kv_out
