"""Launchers for the Triton kernels, with the same contract as ``dsnorm.cpu.launch``'s.

Callers (ops.py) have validated shapes and dtypes: every row tensor is 2-D ``[rows, n]`` with unit
stride along the row and any row stride; ``weight`` is ``[n]`` contiguous in the compute dtype
(fp64 for fp64 inputs, else fp32); ``rstd`` is ``[rows]`` in the compute dtype. Only scratch (the
dweight partials) is allocated here.

Launch heuristics (no autotuning: the first call must not sweep configs):

* ``BLOCK_N`` = next power of two >= n, capped at ``MAX_BLOCK_N`` (wider rows loop over blocks in
  two passes). All DeepSeek widths (7168, 1536, 512) fit in one block.
* ``num_warps`` (forward): ``2 ** floor((log2(BLOCK_N) - 7) / 2)``, so the elements a thread holds
  grow with the row (8 at 512 columns, 16 at 2048, 32 at 8192): 7168 -> 8 warps, 1536 -> 4,
  512 -> 2: chosen on an H200 by benchmarks/gpu_configs.py over every power of two of warps, at
  prefill and decode sizes (the numbers: docs/performance.md).
* ``num_warps`` (backward): one 16-byte vector per thread per block (8 bf16/fp16, 4 fp32, 2 fp64
  elements), clamped to 1..16 warps, or 1..32 (CUDA; 16 on ROCm) for the plain backward of 16-bit
  rows, which keeps fewer row vectors live (x and dy against x, residual and dy): bf16 7168 -> 16
  fused, 32 plain; 1536 -> 8; 512 -> 2. The backward holds fewer elements per thread than the
  forward.
* Rows per program: forward 1 (each program has a single row's worth of loads in flight; many
  small resident programs hide latency better than a loop that serialises rows), more only past
  ``FWD_MAX_PROGRAMS`` rows. Backward: a row block per program so that the dweight partials stay
  small, sized from the row count, ``n``, the dtype and the kind (plain or fused) only (never the
  GPU's SM count), so the partials are the same on any GPU (their final ``torch.sum`` is
  deterministic run to run; torch may size its reduction from the device, so across GPU models
  dweight's bits are not promised, and were never compared): about ``BWD_PROGRAM_THREADS /
  threads-per-program`` programs (``BWD_PROGRAM_THREADS_WIDE`` for 16-bit rows whose block is at
  least ``BWD_WIDE_BLOCK`` columns).
* The launch parameters that depend on the shape, dtypes and flags only are computed once per such
  key (``_plans``): at decode sizes the launch's Python is a visible share of an eager call. On
  CUDA each plan also keeps the kernel Triton compiled for it (per device and argument
  specialisation) and later launches call it directly (``DIRECT_LAUNCH``), about half the
  launcher's host time (docs/performance.md).
* Backward row loop: the next row prefetched into registers (``BWD_PREFETCH``: 16-bit rows whose
  block is at least ``BWD_PREFETCH_MIN_BLOCK``, i.e. n > 2048); not software-pipelined (the
  kernel's ``NUM_STAGES`` is 1: benchmarks/bwd_stages.py launches it pipelined, and
  docs/performance.md says what that measured).

Batch invariance: ``BLOCK_N`` and ``num_warps`` depend on ``n`` and the dtypes only, and a
program's rows are processed one at a time by the same code, so a row's forward bits do not depend
on how many rows share the launch.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

from dsnorm.triton import kernels

# Widest block held in registers: 8192 columns is 16 fp32 values a thread per live row vector at
# 16 warps; the backward keeps about five such vectors live. fp64 halves it.
MAX_BLOCK_N = 8192
MAX_BLOCK_N_FP64 = 4096
MAX_WARPS = 16
# The plain backward (x and dy rows, no residual) of 16-bit rows may use twice the warps: at bf16
# [16384, 7168] on an H200 32 warps took 206 us against 215 us at 16 with 2^18 program threads, and
# 199 against 204 with 2^17 (benchmarks/gpu_configs.py; a second run: 204.5 and 197.9 at 32 warps);
# the fused backward at 32 warps took 336-443 us against 308-318 us at 16. (fp32/fp64 rows were not
# measured and keep MAX_WARPS.) Not on ROCm, where a warp is 64 threads: 32 of them would pass the
# 1024 threads a program may have.
MAX_WARPS_PLAIN_BWD = 16 if torch.version.hip else 32
# Rows beyond this count share programs in the forward (the grid itself is cheap up to here).
FWD_MAX_PROGRAMS = 65536
# The backward's total threads across programs (~ what an H100/H200 keeps resident, 132 SMs x 2048):
# enough programs to fill the GPU, few enough that the [programs, n] partials stay a few MB.
BWD_PROGRAM_THREADS = 1 << 18
# Wide 16-bit rows (a block of at least BWD_WIDE_BLOCK columns: 16-32 warps and prefetched rows,
# one program an SM) get half the programs, each with twice the rows: on an H200 at bf16
# [16384, 7168] the plain backward took 199 us against 206 us with 2^18 threads, the fused 308
# against 318 us. (Narrower rows were within the sweep's noise either way, and fp32/fp64 rows were
# not measured: they keep 2^18.)
BWD_PROGRAM_THREADS_WIDE = 1 << 17
BWD_WIDE_BLOCK = 4096
# The backward's single-block loop loads row i+1 while it reduces row i (the kernel's PREFETCH), for
# blocks of at least BWD_PREFETCH_MIN_BLOCK columns: there a 16-warp program has its SM to itself and
# nothing else hides its load latency. Measured on an H200, fused bf16 [16384, n]: n=7168 318 us
# with it against 359 without; n=1536 113 against 101 and n=512 73 against 68 (several programs
# share an SM there, and the prefetched rows only cost registers). 16-bit inputs only: fp32/fp64 rows
# hold twice the registers and were not measured.
BWD_PREFETCH = True
BWD_PREFETCH_MIN_BLOCK = 4096


def on_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device current for a launch. Triton launches on the
    current device and its current stream, not the tensors': a tensor on ``cuda:1`` while
    ``cuda:0`` is current (``device_map="auto"``, pipeline stages) would be read from the wrong
    GPU and out of order with its own stream. A no-op (no CUDA call beyond the index check) in the
    usual case, and for CPU tensors (the interpreter)."""
    index = t.device.index
    if t.device.type != "cuda" or index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _block(n: int, dtype: torch.dtype) -> int:
    cap = MAX_BLOCK_N_FP64 if dtype == torch.float64 else MAX_BLOCK_N
    return min(triton.next_power_of_2(max(n, 1)), cap)


def config(n: int, dtype: torch.dtype) -> tuple[int, int, bool]:
    """Forward (and the fusions'): ``(BLOCK_N, num_warps, single_block)`` for rows of width ``n`` in
    ``dtype``; the row count never enters (batch invariance)."""
    block = _block(n, dtype)
    warps = 1 << max(0, (block.bit_length() - 1 - 7) // 2)
    return block, max(1, min(MAX_WARPS, warps)), n <= block


def backward_config(n: int, dtype: torch.dtype, fused: bool = True) -> tuple[int, int, bool]:
    """Backward: ``(BLOCK_N, num_warps, single_block)``, one 16-byte vector per thread per block;
    ``fused``: the backward has a residual (it keeps more row vectors live, so fewer warps)."""
    block = _block(n, dtype)
    per_thread = max(1, 16 // dtype.itemsize)
    cap = MAX_WARPS if fused or dtype.itemsize != 2 else MAX_WARPS_PLAIN_BWD
    warps = max(1, min(cap, block // per_thread // 32))
    return block, warps, n <= block


def backward_rows_per_program(rows: int, n: int, dtype: torch.dtype, fused: bool = True) -> int:
    """The dweight row block: a function of the shape, dtype and kind only."""
    block, warps, _ = backward_config(n, dtype, fused)
    wide = block >= BWD_WIDE_BLOCK and dtype.itemsize == 2
    threads = BWD_PROGRAM_THREADS_WIDE if wide else BWD_PROGRAM_THREADS
    programs = max(1, threads // (32 * warps))
    return max(1, -(-rows // programs))


def _ptr(t, fallback):
    return fallback if t is None else t


def _stride(t):
    return 0 if t is None else t.stride(0)


# Launch a kernel already compiled for a plan by calling it directly (CUDA only). Triton's own
# ``kernel[grid](...)`` binds and specialises every argument and rebuilds its cache key in Python
# at each call: on the H200's host that was the largest share of an eager call's own time
# (benchmarks/gpu_host_profile.py). The first launch of each plan and specialisation still goes
# through Triton, which compiles, launches and hands back the compiled kernel kept here. A module
# setting so that the benchmarks and the tests can compare both ways. Off on ROCm: its backend
# also specialises a tensor on its storage's size (32-bit buffer offsets), which the key below
# does not hold, and it was never measured there.
DIRECT_LAUNCH = not torch.version.hip
# Compiled kernels kept per plan (a plan has one per device and specialisation, usually one).
_LAUNCHES_MAX = 64
_INT32_MIN, _INT32_MAX, _UINT64_FROM = -(2**31), 2**31 - 1, 2**63


class _Launches:
    """A plan's compiled kernels, by device and specialisation, and what a direct launch passes
    beside the runtime arguments: the grid as three dimensions and the constexprs in the kernel's
    parameter order (a compiled kernel's launcher takes every parameter, constexprs included).
    ``kernel``: the jit function they were compiled from (a reloaded or replaced one starts over)."""

    __slots__ = ("grid3", "kernel", "constexprs", "compiled")

    def __init__(self, grid: tuple):
        self.grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.kernel = None
        self.constexprs = None
        self.compiled = {}


def _specialisation(args) -> tuple:
    """What Triton compiles a launch for beyond its constexprs and options, as its runtime does (and
    so what one compiled kernel may be reused for): each tensor's dtype and whether its address is a
    multiple of 16 bytes; each integer's being 1 (then a constexpr), a multiple of 16, and its type
    (i32, i64, or u64 from 2**63). Floats are not specialised (eps is typed fp64).
    tests/test_triton_interpret.py holds this against Triton's own specialisation."""
    spec = []
    for a in args:
        if type(a) is int:
            kind = 0 if _INT32_MIN <= a <= _INT32_MAX else (2 if a >= _UINT64_FROM else 1)
            spec.append((a == 1, a % 16 == 0, kind))
        elif type(a) is not float:
            spec.append((a.dtype, a.data_ptr() % 16 == 0))
    return tuple(spec)


def _default_knobs() -> bool:
    """Whether the Triton settings that its runtime also keys compiled kernels on are unset: device
    asserts (``TRITON_DEBUG``), Proton's instrumentation, and in Triton 3.9 the fp sanitizer's casts
    and the stage-inspection hook. With any of them set every launch goes through Triton (and
    what it compiles then is not kept), so that setting one after the first launch takes effect."""
    knobs = triton.knobs
    return not (knobs.runtime.debug or knobs.compilation.instrumentation_mode
                or getattr(knobs.compilation, "fpsan_homomorphic_casts", False)
                or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None)


def _launch(kernel, grid, args, meta, launches: _Launches) -> None:
    """``kernel[grid](*args, **meta)``: on CUDA tensors, launches after a plan's first (per device and
    specialisation) call the kernel Triton compiled for it directly; elsewhere (the interpreter)
    Triton's own launch."""
    if not (DIRECT_LAUNCH and args[0].is_cuda and _default_knobs()):
        kernel[grid](*args, **meta)
        return
    if launches.kernel is not kernel:
        launches.kernel, launches.constexprs, launches.compiled = kernel, None, {}
    key = (args[0].get_device(), _specialisation(args))
    compiled = launches.compiled.get(key)
    if compiled is not None:
        compiled[launches.grid3](*args, *launches.constexprs)
        return
    compiled = kernel[grid](*args, **meta)
    if not isinstance(compiled, CompiledKernel):
        return  # e.g. Triton 3.9's asynchronous compile mode hands back a future: nothing to keep
    if launches.constexprs is None:
        # The kernel's parameters after the runtime arguments are its constexprs, all in meta.
        launches.constexprs = tuple(meta[name] for name in kernel.arg_names[len(args):])
    if len(launches.compiled) >= _LAUNCHES_MAX:
        launches.compiled.clear()
    launches.compiled[key] = compiled


# Launch parameters that depend on the shape, dtypes and flags only, per such key. The key also
# holds the settings ``_settings`` lists (the module's constants and the two config functions that
# benchmarks/gpu_configs.py and the tests replace), so a change to those is never served a stale
# plan; the helpers behind them (``_block``, ``_compute_dtype``...) are not in it and must not be
# replaced at run time. Bounded: a training run with varying row counts adds a key per count.
_plans: dict = {}
_PLANS_MAX = 4096


def _settings() -> tuple:
    return (MAX_BLOCK_N, MAX_BLOCK_N_FP64, MAX_WARPS, MAX_WARPS_PLAIN_BWD, FWD_MAX_PROGRAMS,
            BWD_PROGRAM_THREADS, BWD_PROGRAM_THREADS_WIDE, BWD_WIDE_BLOCK, BWD_PREFETCH,
            BWD_PREFETCH_MIN_BLOCK, config, backward_config)


def _remember(key, plan):
    if len(_plans) >= _PLANS_MAX:
        _plans.clear()
    _plans[key] = plan
    return plan


# Options (not constexprs) of every launch a norm's forward makes, its fusions' included. Triton
# contracts a multiply and an add into one fma by default; in the sum of squares that keeps one
# square of each pair unrounded where the reference rounds every square (a tree's first level
# s0*s0 + s1*s1 becomes fma(s0, s0, s1*s1)). In normal ranges that is one more summation-order
# freedom; with subnormal squares (|x| ~ 1e-22) and eps below FLT_MIN, where the squares' own
# roundings dominate the mean, it moved y by several ulps (sm_90 PTX, emulated: 9 ulps). Off, the
# forward kernels' float arithmetic is the reference's operation for operation.
FWD_OPTIONS = {"enable_fp_fusion": False}
# Launch options in meta beside the constexprs (the ahead-of-time compile test tells them apart).
OPTION_NAMES = ("num_warps", "enable_fp_fusion")


def _forward_plan(rows, n, dtype, has_residual, has_residual_out, round_first, cast_hf, store_rstd):
    key = ("fwd", rows, n, dtype, has_residual, has_residual_out, round_first, cast_hf, store_rstd, _settings())
    plan = _plans.get(key)
    if plan is not None:
        return plan
    block, warps, single = config(n, dtype)
    rows_per_prog = -(-rows // FWD_MAX_PROGRAMS)
    meta = dict(
        ROWS_PER_PROG=rows_per_prog,
        BLOCK_N=block,
        SINGLE_BLOCK=single,
        HAS_RESIDUAL=has_residual,
        HAS_RESIDUAL_OUT=has_residual_out,
        ROUND_FIRST=round_first and has_residual,
        CAST_HF=cast_hf,
        STORE_RSTD=store_rstd,
        CD=_compute_dtype(dtype),
        num_warps=warps,
        **FWD_OPTIONS,
    )
    grid = (-(-rows // rows_per_prog),)
    return _remember(key, (grid, meta, _Launches(grid)))


def _forward_args(x, residual, weight, eps, y, residual_out, rstd) -> tuple:
    """The forward kernel's runtime arguments; None-tensors are replaced by valid unused pointers,
    their strides by 0."""
    return (
        x, _ptr(residual, x), weight, y, _ptr(residual_out, y), _ptr(rstd, weight),
        x.stride(0), _stride(residual), y.stride(0), _stride(residual_out),
        x.shape[0], x.shape[1], float(eps),
    )


def _forward_checked_plan(x, residual, weight, cast_hf, round_first, y, residual_out, rstd):
    rows, n = x.shape
    # Unit stride along the row (a width-1 row has no stride to speak of: only column 0 is read).
    assert n == 1 or (x.stride(1) == 1 and y.stride(1) == 1)
    assert weight.is_contiguous() and (residual_out is None or residual is not None)
    return _forward_plan(rows, n, x.dtype, residual is not None, residual_out is not None, bool(round_first),
                         bool(cast_hf), rstd is not None)


def forward_params(x, residual, weight, eps, cast_hf, round_first, y, residual_out, rstd):
    """``(grid, args, meta)`` of the forward launch (also what the ahead-of-time compile test
    compiles); None-tensors are replaced by valid unused pointers, their strides by 0. ``meta`` is
    shared between launches of one key: read it, do not change it."""
    grid, meta, _ = _forward_checked_plan(x, residual, weight, cast_hf, round_first, y, residual_out, rstd)
    return grid, _forward_args(x, residual, weight, eps, y, residual_out, rstd), meta


def _rows(t):
    """[rows, n] view of a tensor whose leading dims collapse to one row stride (ops.py checks)."""
    return t if t is None or t.dim() == 2 else t.view(-1, t.shape[-1])


def empty_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous output of ``like``'s shape on its device. (``empty_like`` took half the
    host time of ``torch.empty`` with a device argument on the CI machine's CPU tensors, 0.9 against
    1.9 us: this runs for every output of every call.)"""
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


def forward(x, residual, weight, eps, cast_hf, round_first, y, residual_out, rstd) -> None:
    """y = weight * s * rsqrt(mean(s^2) + eps), s = x (+ residual); residual_out = s; rstd saved.

    Tensors of any leading shape whose rows have one stride (the interface of ``dsnorm.cpu.launch``);
    launched as 2-D.
    """
    forward_2d(_rows(x), _rows(residual), weight, eps, cast_hf, round_first, _rows(y), _rows(residual_out),
               None if rstd is None else rstd.view(-1))


def forward_2d(x, residual, weight, eps, cast_hf, round_first, y, residual_out, rstd) -> None:
    """``forward`` on 2-D tensors.

    x, y: [rows, n] (y may be x); residual, residual_out: [rows, n] or None (residual_out may be
    residual); weight: [n] in the compute dtype; rstd: [rows] in the compute dtype or None.
    """
    rows, n = x.shape
    if rows == 0 or n == 0:
        return
    grid, meta, launches = _forward_checked_plan(x, residual, weight, cast_hf, round_first, y, residual_out, rstd)
    args = _forward_args(x, residual, weight, eps, y, residual_out, rstd)
    with on_device(x):
        _launch(kernels.rms_norm_fwd_kernel, grid, args, meta, launches)


def _backward_plan(rows, n, dtype, dy_dtype, residual_dtype, dro_dtype, dr_dtype, round_first):
    """``(programs, meta, partials dtype, partials zeroed, compiled launches)`` for the backward of this key
    (``dr_dtype``: dresidual's, None when it is not written)."""
    key = ("bwd", rows, n, dtype, dy_dtype, residual_dtype, dro_dtype, dr_dtype, round_first, _settings())
    plan = _plans.get(key)
    if plan is not None:
        return plan
    fused = residual_dtype is not None
    block, warps, single = backward_config(n, dtype, fused)
    rows_per_prog = backward_rows_per_program(rows, n, dtype, fused)
    meta = dict(
        ROWS_PER_PROG=rows_per_prog,
        BLOCK_N=block,
        SINGLE_BLOCK=single,
        HAS_RESIDUAL=fused,
        HAS_DRO=dro_dtype is not None,
        HAS_DR=dr_dtype is not None,
        ROUND_FIRST=round_first and fused,
        PREFETCH=BWD_PREFETCH and single and block >= BWD_PREFETCH_MIN_BLOCK and dtype.itemsize == 2,
        NUM_STAGES=1,  # the row loop is not software-pipelined (benchmarks/bwd_stages.py pipelines it)
        CD=_compute_dtype(dtype),
        num_warps=warps,
    )
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    programs = -(-rows // rows_per_prog)
    return _remember(key, (programs, meta, cdtype, not single, _Launches((programs,))))


def _dtype(t):
    return None if t is None else t.dtype


def _backward_args(dy, x, residual, weight, rstd, dresidual_out, dx, dresidual, partials) -> tuple:
    """The backward kernel's runtime arguments; None-tensors as in ``forward_params``."""
    assert dresidual is None or residual is not None
    assert dresidual_out is None or residual is not None
    return (
        dy, x, _ptr(residual, x), weight, rstd, _ptr(dresidual_out, dy), dx, _ptr(dresidual, dx), partials,
        dy.stride(0), x.stride(0), _stride(residual), _stride(dresidual_out), dx.stride(0), _stride(dresidual),
        x.shape[0], x.shape[1],
    )


def _partials(programs: int, n: int, cdtype: torch.dtype, zeroed: bool, device) -> torch.Tensor:
    # The multi-block path accumulates into its row of the partials, so they are zeroed there. (Sizes
    # as separate ints: a tuple is parsed more slowly, ~0.3 us a call on the CI machine's CPU.)
    return (torch.zeros if zeroed else torch.empty)(programs, n, dtype=cdtype, device=device)


def backward_params(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, partials):
    """``(grid, args, meta)`` of the backward launch; ``partials`` is the [programs, n] scratch
    (see ``backward_partials``). ``meta`` is shared between launches of one key: read it only."""
    rows, n = x.shape
    programs, meta, _, _, _ = _backward_plan(rows, n, x.dtype, dy.dtype, _dtype(residual), _dtype(dresidual_out),
                                             _dtype(dresidual), bool(round_first))
    assert partials.shape == (programs, n) and partials.is_contiguous()
    return (programs,), _backward_args(dy, x, residual, weight, rstd, dresidual_out, dx, dresidual, partials), meta


def backward_partials(x, fused: bool = True) -> torch.Tensor:
    """The dweight partials buffer, [programs, n] in the compute dtype, for the backward of ``x``'s
    rows (``fused``: with a residual; a plain backward needs ``fused=False``), as ``backward_2d``
    allocates it. For callers of ``backward_params`` (the tests, the ahead-of-time compiles)."""
    rows, n = x.shape
    # The row blocks, the partials' dtype and their zeroing depend on x's dtype and the kind only.
    programs, _, cdtype, zeroed, _ = _backward_plan(rows, n, x.dtype, x.dtype, x.dtype if fused else None, None,
                                                    None, False)
    return _partials(programs, n, cdtype, zeroed, x.device)


def backward(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, dweight) -> None:
    """``backward_2d`` for tensors of any leading shape whose rows have one stride."""
    backward_2d(_rows(dy), _rows(x), _rows(residual), weight, rstd.reshape(-1), _rows(dresidual_out),
                round_first, _rows(dx), _rows(dresidual), dweight)


def backward_2d(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, dweight) -> None:
    """Gradients of ``forward``: dx (x.dtype), dresidual (residual's dtype; None: not written, the
    caller's dx serves both), dweight ([n], written).

    ds = rstd * (g - xhat * mean(g * xhat)) + dresidual_out, g = dy * weight, xhat = s * rstd;
    dweight = sum over rows of dy * xhat: per-program partials over fixed row blocks, then one
    ``torch.sum`` over the partials (a fixed-shape reduction, deterministic).
    """
    rows, n = x.shape
    if n == 0:
        return
    if rows == 0:
        dweight.zero_()
        return
    programs, meta, cdtype, zeroed, launches = _backward_plan(rows, n, x.dtype, dy.dtype, _dtype(residual),
                                                              _dtype(dresidual_out), _dtype(dresidual),
                                                              bool(round_first))
    partials = _partials(programs, n, cdtype, zeroed, x.device)
    args = _backward_args(dy, x, residual, weight, rstd, dresidual_out, dx, dresidual, partials)
    with on_device(x):
        _launch(kernels.rms_norm_bwd_kernel, (programs,), args, meta, launches)
    if dweight.dtype == partials.dtype:
        torch.sum(partials, dim=0, out=dweight)
    else:
        dweight.copy_(partials.sum(dim=0))
