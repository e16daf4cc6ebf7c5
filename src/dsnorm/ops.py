"""``torch.library`` custom ops (namespace ``dsnorm``), their checks, fake impls and device dispatch.

Ops (``torch.ops.dsnorm.*``):

* ``rms_norm(x, weight, eps, cast) -> y`` (inference: nothing saved)
* ``fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype)
  -> (y, residual_out)`` (inference)
* ``rms_norm_fwd(x, weight, eps, cast) -> (y, rstd)`` (training: also the per-row rstd)
* ``fused_add_rms_norm_fwd(x, residual, weight, eps, cast, residual_rounding, residual_dtype)
  -> (y, residual_out, rstd)``
* ``fused_add_rms_norm_(x!, residual!, weight, eps, cast, residual_rounding) -> ()`` (in place)
* ``rms_norm_bwd(dy, x, weight, rstd) -> (dx, dweight)``
* ``fused_add_rms_norm_bwd(dy, x, residual, weight, rstd, dresidual_out, residual_rounding)
  -> (dx, dresidual, dweight)``

Every op takes tensors of any leading shape and a unit-stride last dimension (other inputs are
copied once); ``weight`` is already in the compute dtype (fp32, fp64 for fp64 ``x``): the
functional API upcasts other weights. The ops are defined with the low-level
``torch.library.Library`` API: ``@custom_op`` adds several microseconds of Python per call, which
is more than a decode-sized norm costs. The CPU key runs the numba kernels (:mod:`dsnorm.cpu`), the
CUDA key the Triton kernels (:mod:`dsnorm.triton.launch`, imported on first CUDA use).
"""

from __future__ import annotations

import math
import numbers
import os
import sys

import torch

from dsnorm.ref import CASTS, RESIDUAL_ROUNDINGS, compute_dtype

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Tensor types whose data the kernels may be handed directly (no subclass with its own dispatch).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

lib = torch.library.Library("dsnorm", "DEF")  # noqa: TOR901 (kept alive for the process)
lib.define("rms_norm(Tensor x, Tensor weight, float eps, str cast) -> Tensor")
lib.define(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, str cast, "
    "str residual_rounding, ScalarType? residual_dtype) -> (Tensor, Tensor)"
)
lib.define("rms_norm_fwd(Tensor x, Tensor weight, float eps, str cast) -> (Tensor, Tensor)")
lib.define(
    "fused_add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps, str cast, "
    "str residual_rounding, ScalarType? residual_dtype) -> (Tensor, Tensor, Tensor)"
)
lib.define(
    "fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str cast, "
    "str residual_rounding) -> ()"
)
lib.define("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)")
lib.define(
    "fused_add_rms_norm_bwd(Tensor dy, Tensor x, Tensor residual, Tensor weight, Tensor rstd, "
    "Tensor? dresidual_out, str residual_rounding) -> (Tensor, Tensor, Tensor)"
)


# ---------------------------------------------------------------------------------------------
# Fork: numba's GNU OpenMP pool cannot serve a forked child (numba terminates the child, SIGTERM,
# on its first parallel launch), so a child of a process whose pool ran sets this and dsnorm.cpu
# runs every call there on the calling thread (torch's DataLoader workers use one thread anyway;
# numba's tbb and workqueue layers are fork-safe). Registered here, at import, rather than in
# dsnorm.cpu (loaded on first use), so that a pool started by other code before that is seen too.
forked_after_pool = False


def _after_fork_in_child() -> None:
    global forked_after_pool
    numba = sys.modules.get("numba")
    if numba is None:  # numba not imported: no pool can have run
        return
    try:
        layer = numba.threading_layer()
    except ValueError:  # no pool ran in the parent: the child starts its own
        return
    if layer == "omp":
        from numba.np.ufunc import omppool

        forked_after_pool = omppool.openmp_vendor == "GNU"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Checks: shared by the real impls and the fakes, so bad input fails the same way eagerly and
# under torch.compile, and before anything is written. They run on every call, so the common
# case is kept to a few attribute reads.

_OPTIONS_OK: set = set()
# eps is added to an fp32 mean square, as a Python float rounded to float32 (torch does that with
# ``var + eps``): accepted is every value whose float32 rounding is nonzero and finite. Below, it
# would be 0 (a zero row then divides by 0); above, inf (the reference's y is then 0). The bounds
# are the doubles at the ends of that range (1e-45 rounds up to float32's least subnormal,
# 3.4028235e38, the usual printed form of its largest value, rounds down to it). The same range
# for fp64 inputs, which add eps unrounded in fp64. NaN fails both comparisons.
EPS_MIN = math.nextafter(2.0**-150, math.inf)
EPS_MAX = math.nextafter(2.0**128 - 2.0**103, 0.0)


def _as_float(value) -> float:
    """A real number as a Python float (inf past float's range), so that the bounds are compared as
    doubles: numpy 2 would compare an ``np.float16`` against them in float16 (0 and inf)."""
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def check_options(eps, cast, residual_rounding="fp32_sum", residual_dtype=None) -> None:
    # The cache of accepted options is not touched while dynamo traces: it would guard on the set's
    # contents, and any later eager call with new options would then make compiled code recompile.
    cached = not _is_compiling()
    key = (type(eps), eps, cast, residual_rounding, residual_dtype)
    try:
        if cached and key in _OPTIONS_OK:
            return
    except TypeError:  # an unhashable option: the checks below name it
        pass
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not EPS_MIN <= _as_float(eps) <= EPS_MAX:
        raise ValueError(f"eps must be a number > 0 whose float32 rounding is nonzero and finite (about 1.4e-45 "
                         f"to 3.4e38), got {eps!r}")
    if not isinstance(cast, str) or cast not in CASTS:
        raise ValueError(f"cast must be one of {CASTS}, got {cast!r}")
    if not isinstance(residual_rounding, str) or residual_rounding not in RESIDUAL_ROUNDINGS:
        raise ValueError(f"residual_rounding must be one of {RESIDUAL_ROUNDINGS}, got {residual_rounding!r}")
    if residual_dtype is not None and residual_dtype is not torch.float32:
        raise ValueError(f"residual_dtype must be None (x.dtype) or torch.float32, got {residual_dtype!r}")
    if residual_rounding == "round_first" and residual_dtype is not None:
        raise ValueError(
            "residual_rounding='round_first' with residual_dtype=torch.float32 is contradictory: "
            "round_first rounds the residual stream to x.dtype; use residual_dtype=None"
        )
    if cached and len(_OPTIONS_OK) < 1024:
        _OPTIONS_OK.add(key)


def check_inplace_options(eps, cast, residual_rounding, x: torch.Tensor, residual: torch.Tensor) -> None:
    """``check_options`` for the in-place form, which has no ``residual_dtype``: its residual
    buffer's dtype says whether the stream is fp32 (its other options are ``check_options``'s
    without a residual_dtype), and the contradiction is named in those terms."""
    check_options(eps, cast, residual_rounding)
    if residual.dtype != x.dtype and residual_rounding == "round_first":
        raise ValueError(
            f"residual_rounding='round_first' with a {residual.dtype} residual buffer beside x's {x.dtype} is "
            "contradictory: round_first rounds the residual stream to x.dtype; pass a residual of x's dtype "
            "(or residual_rounding='fp32_sum' to keep an fp32 stream)")


def is_dtensor(t) -> bool:
    """True for a DTensor, without importing torch.distributed.tensor (~0.5 s): no DTensor exists
    before its import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_dense(t: torch.Tensor, name: str) -> None:
    # Sparse, mkldnn and nested tensors have no rows of unit stride to read (a nested tensor has
    # no shape at all): refused by name rather than by whatever torch raises deeper down.
    if t.is_nested or t.layout is not torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (torch.strided) tensor, got {kind}")


def check_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_dense(x, name)
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (the normalised one), got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"{name} must have a last dimension of width >= 1, got shape {tuple(x.shape)}")


def check_weight(weight: torch.Tensor, x: torch.Tensor, x_name: str = "x") -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    check_dense(weight, "weight")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape ({x.shape[-1]},) to match {x_name}'s last dimension, got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x_name}'s device {x.device}, got {weight.device}")
    if not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous (unit stride) at the op level, got stride {weight.stride()}; "
            "dsnorm.rms_norm and friends make it so"
        )
    if weight.dtype != compute_dtype(x.dtype):
        raise TypeError(
            f"weight must be {compute_dtype(x.dtype)} (the compute dtype for {x_name} of {x.dtype}) at the op "
            f"level, got {weight.dtype}; dsnorm.rms_norm and friends upcast other weights exactly"
        )


# The residual dtypes the fused form adds to an x of these dtypes: the reference adds
# ``residual.float()`` to ``x.float()`` whatever the residual's dtype, and returns the sum in
# x.dtype. Under torch.autocast, for one, the first block's ffn_norm gets a bf16 x and the fp32
# embedding as its residual. Each widens to fp32 exactly, so the kernels' sum is the reference's.
# An fp64 residual is refused beside them: the reference rounds it to fp32 before the sum, a
# rounding the CPU kernel's widening add does not make. fp64 x keeps its own dtype (or fp32 with
# residual_dtype=torch.float32): it is computed in fp64, not as the reference's x.float().
_WIDENED_RESIDUALS = (torch.float32, torch.bfloat16, torch.float16)


def residual_dtypes(x_dtype: torch.dtype, residual_dtype, mixed: bool = True) -> tuple:
    """The residual dtypes accepted beside an x of ``x_dtype`` (x's own first). ``mixed=False``:
    x.dtype, or also float32 with ``residual_dtype=torch.float32`` (the in-place form, whose
    residual buffer is also its output, and the fusions)."""
    if mixed and x_dtype in _WIDENED_RESIDUALS:
        return (x_dtype,) + tuple(d for d in _WIDENED_RESIDUALS if d is not x_dtype)
    return (x_dtype,) if residual_dtype is None else tuple(dict.fromkeys((x_dtype, torch.float32)))


def check_same_sizes(a, b, message) -> None:
    """Raise ``ValueError(message())`` unless the shapes ``a`` and ``b`` are equal. Under
    torch.compile a pair of sizes no guard can decide (sizes from ``.item()``, slices of buffers of
    other lengths) is asserted when the graph runs instead, as the reference's ``x + residual`` is:
    where that fails, torch raises its own RuntimeError naming the size expression (``Eq(u1, u0)``)."""
    if len(a) != len(b):
        raise ValueError(message())
    for p, q in zip(a, b):
        if type(p) is int and type(q) is int:
            if p != q:
                raise ValueError(message())
        else:
            torch._check_value(p == q, message)


def check_residual(residual: torch.Tensor, x: torch.Tensor, residual_dtype, name: str = "residual",
                   fp32_hint: bool = True, x_name: str = "x", mixed: bool = True, why: str | None = None) -> None:
    """The residual beside ``x``: a dense tensor of x's shape and device, of a dtype
    ``residual_dtypes`` accepts. ``why``: the rule the dtype error states (default: the
    ``residual_dtype`` option's)."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(residual).__name__}")
    check_dense(residual, name)
    check_same_sizes(residual.shape, x.shape,
                     lambda: f"{name} must have {x_name}'s shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"{name} must be on {x_name}'s device {x.device}, got {residual.device}")
    allowed = residual_dtypes(x.dtype, residual_dtype, mixed)
    if residual.dtype not in allowed:
        want = " or ".join(str(d) for d in dict.fromkeys(allowed))
        hint = ""
        if residual.dtype == torch.float32 and fp32_hint:
            hint = "; pass residual_dtype=torch.float32 to carry an fp32 residual stream"
        why = why or f"residual_dtype={residual_dtype}"
        raise TypeError(f"{name} must be {want} ({why}), got {residual.dtype}{hint}")


def check_inplace_residual(residual: torch.Tensor, x: torch.Tensor) -> None:
    """In place the residual buffer is also the output: x's dtype, or an fp32 stream (its own
    dtype decides which)."""
    check_residual(residual, x, torch.float32, mixed=False, why="in place: x's dtype, or an fp32 residual stream")


def _rstd_like(x: torch.Tensor) -> torch.Tensor:
    # The leading sizes as separate ints: new_empty parses a torch.Size argument more slowly (~1.7
    # us against ~1.1 on the CI machine's CPU, once per training forward).
    lead = x.shape[:-1]
    return x.new_empty(*lead, dtype=compute_dtype(x.dtype)) if lead else x.new_empty((), dtype=compute_dtype(x.dtype))


# ---------------------------------------------------------------------------------------------
# Geometry: kernels read rows of unit stride whose leading dims collapse to one row stride (the
# kv_norm input, a 512-of-576 slice, is read in place). Anything else is copied once.


def rows_viewable(t: torch.Tensor) -> bool:
    """True if ``t`` is ``[..., n]`` with unit stride along n and one stride between rows."""
    if t.is_contiguous():
        return True
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    expected = None
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def readable_rows(t: torch.Tensor) -> torch.Tensor:
    return t if rows_viewable(t) else t.contiguous()


def row_stride(t: torch.Tensor) -> int:
    """Element stride between rows of a ``[..., n]`` tensor whose leading dims collapse to one
    stride (``rows_viewable``): no 2-D view is built, since a view costs ~1 µs at decode."""
    if t.is_contiguous():
        return t.shape[-1]
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1:
            return stride
    return t.shape[-1]


# ---------------------------------------------------------------------------------------------
# Device dispatch: the launchers of one device share one interface.

_launchers: dict = {}


def _launcher(x: torch.Tensor):
    """The launcher module for x's device (looked up by a cheap flag: this runs on every call)."""
    kind = "cpu" if x.is_cpu else x.device.type
    launcher = _launchers.get(kind)
    if launcher is None:
        launcher = _launchers[kind] = _load_launcher(x.device)
    return launcher


def _load_launcher(device: torch.device):
    if device.type == "cpu":
        from dsnorm import cpu

        return cpu
    if device.type == "cuda":
        try:
            from dsnorm.triton import launch
        except ImportError as e:  # no slow eager fallback: say what is missing
            raise RuntimeError(
                "dsnorm needs Triton for CUDA tensors (pip install 'dsnorm[gpu]'): " + str(e)
            ) from e
        return launch
    raise NotImplementedError(f"dsnorm has kernels for cpu and cuda tensors, not {device.type}")


_COMPUTE_DTYPE = {d: compute_dtype(d) for d in INPUT_DTYPES}


_STRIDED = torch.strided


def _common_case(x, weight) -> bool:
    """A few attribute reads that prove what check_input and check_weight would check, for the
    common case; anything else goes through those checks (and their messages)."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.layout is _STRIDED and weight.layout is _STRIDED and not x.is_nested
        and _COMPUTE_DTYPE.get(x.dtype) is weight.dtype
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0] > 0
        and weight.is_contiguous()
        and (x.is_cpu if weight.is_cpu else weight.device == x.device)
    )


def _plain(x, weight, eps, cast, save_rstd):
    if not _common_case(x, weight):
        check_input(x)
        check_weight(weight, x)
    check_options(eps, cast)
    return _plain_launch(readable_rows(x), weight, eps, cast, save_rstd)


def _plain_launch(x, weight, eps, cast, save_rstd):
    """The outputs allocated and the kernel launched, for arguments that passed ``_plain``'s checks
    and rows the kernels read in place."""
    launcher = _launcher(x)
    y = launcher.empty_output(x, x.dtype)
    rstd = _rstd_like(x) if save_rstd else None
    launcher.forward(x, None, weight, eps, cast == "hf", False, y, None, rstd)
    return y, rstd


def _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, save_rstd):
    if not _common_case(x, weight):
        check_input(x)
        check_weight(weight, x)
    check_residual(residual, x, residual_dtype)
    check_options(eps, cast, residual_rounding, residual_dtype)
    return _fused_launch(readable_rows(x), readable_rows(residual), weight, eps, cast, residual_rounding,
                         residual_dtype, save_rstd)


def _fused_launch(x, residual, weight, eps, cast, residual_rounding, residual_dtype, save_rstd):
    """As ``_plain_launch``, for ``_fused``."""
    launcher = _launcher(x)
    y = launcher.empty_output(x, x.dtype)
    residual_out = launcher.empty_output(x, residual_dtype or x.dtype)
    rstd = _rstd_like(x) if save_rstd else None
    launcher.forward(
        x, residual, weight, eps, cast == "hf", residual_rounding == "round_first", y, residual_out, rstd
    )
    return y, residual_out, rstd


# The training forward's lane (dsnorm.autograd): its common case proved in one expression, in place
# of the public function's argument checks and row handling (autograd._rows, _savable), the
# Function's probe (autograd._direct) and the forward op's checks (check_input, check_weight,
# check_residual, check_options, readable_rows): ~7.6 us of a ~20 us fused training forward on the
# CI machine. It holds for plain tensors whose rows the kernels read in place (contiguous, or strided
# rows such as kv_norm's 512-of-576 slice) on the CPU or on x's CUDA device, outside every transform,
# trace, mode and profiler, with options an earlier call has checked (residual_dtype None); anything
# else takes those checks and their messages. ``weight``: the compute-dtype gain
# (autograd._compute_weight's).
_transforms_active = torch._C._are_functorch_transforms_active
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_memory(t: torch.Tensor) -> bool:
    """``t`` is memory the kernels may read directly: a plain tensor (no subclass with a dispatch of
    its own) on the CPU or a CUDA device. Meta tensors (and other devices) take the op: its fake
    implementation shapes them. So do a lazily negated view (x.conj().imag), a ZeroTensor (no
    memory) and a functorch wrapper left over from a finished transform (torch.func.vjp's saved
    inputs, when its vjp function is called afterwards: no storage): the dispatcher resolves them,
    the kernels read raw memory."""
    return (type(t) in PLAIN_TYPES and (t.is_cpu or t.is_cuda)
            and not (t.is_neg() or t._is_zerotensor() or _is_wrapped(t)))


def train_lane_plain(x, weight, eps, cast) -> bool:
    return _train_lane(x, None, weight, (type(eps), eps, cast, "fp32_sum", None))


def train_lane_fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype) -> bool:
    return residual_dtype is None and _train_lane(x, residual, weight, (type(eps), eps, cast, residual_rounding, None))


def _train_lane(x, residual, weight, options) -> bool:
    """The lane's proof; ``options``: check_options' cache key; ``residual``: None for the plain form."""
    # dispatch_free first: while dynamo traces it is False without a guard, and the options cache
    # must not be read then (a guard on its contents: see check_options).
    if not dispatch_free():
        return False
    try:
        if options not in _OPTIONS_OK:
            return False
    except TypeError:  # an unhashable option
        return False
    if not (
        plain_memory(x) and plain_memory(weight) and not _transforms_active()
        and x.layout is _STRIDED and weight.layout is _STRIDED and not x.is_nested and not weight.is_nested
        and _COMPUTE_DTYPE.get(x.dtype) is weight.dtype
        and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0] > 0
        and (x.is_contiguous() or rows_viewable(x)) and weight.is_contiguous()
        and (weight.is_cpu if x.is_cpu else weight.device == x.device)
        and not x.is_inference() and not weight.is_inference()
    ):
        return False
    return residual is None or (
        plain_memory(residual) and residual.layout is _STRIDED and not residual.is_nested
        and residual.dtype is x.dtype and residual.shape == x.shape
        and (residual.is_contiguous() or rows_viewable(residual))
        and (residual.is_cpu if x.is_cpu else residual.device == x.device)
        and not residual.is_inference()
    )


def rms_norm_fwd_unchecked(x, weight, eps, cast):
    """``rms_norm_fwd`` for arguments ``train_lane_plain`` accepted."""
    return _plain_launch(x, weight, eps, cast, True)


def fused_add_rms_norm_fwd_unchecked(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    """``fused_add_rms_norm_fwd`` for arguments ``train_lane_fused`` accepted."""
    return _fused_launch(x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)


_is_compiling = torch.compiler.is_compiling
_functorch_level = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_tracing_state = torch._C._get_tracing_state
_profiler_enabled = torch._C._autograd._profiler_enabled
_forward_ad = torch.autograd.forward_ad  # its _current_level is -1 unless a dual level is open


def dispatch_free() -> bool:
    """True when nothing observes or transforms op calls: no torch.compile/export tracing (checked
    first: nothing after it needs tracing), functorch transform, torch dispatch or function mode,
    torch.jit trace (which records ops, not what an implementation does) or torch.profiler (which
    records ops at the dispatcher) and no forward-mode AD level (a dual input's tangent would be
    dropped). Then calling an op's implementation directly is indistinguishable from calling the op. The probes are torch's C functions without their Python
    wrappers: this runs on every decode call."""
    return not (
        _is_compiling() or _functorch_level() is not None or _dispatch_modes() or _function_modes()
        or _tracing_state() or _profiler_enabled() or _forward_ad._current_level >= 0
    )


def refuse_forward_ad(what: str, *tensors) -> None:
    """Forward-mode AD (``torch.autograd.forward_ad``) has no formula in dsnorm: an input carrying a
    tangent is refused by name (the ops would drop it silently). Free when no dual level is open."""
    if _forward_ad._current_level < 0:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{what} has no forward-mode AD (jvp) formula: an input is a dual tensor "
                "(torch.autograd.forward_ad.make_dual); use reverse mode (backward, torch.func.vjp) instead"
            )


def _load_lane():
    # The CPU kernels' fast lane (dsnorm.cpu is imported on first use: importing dsnorm loads no
    # numba). The ops' implementations try it first, and so, from then on, do the functional API
    # and the module, which call it without the dispatcher's round trip.
    global lane
    if lane is None:
        from dsnorm import cpu

        lane = cpu.lane
    return lane


# dsnorm.cpu.lane once loaded; its forms are dsnorm.cpu.PLAIN, FUSED, INPLACE.
lane = None
LANE_PLAIN, LANE_FUSED, LANE_INPLACE = 0, 1, 2


def rms_norm(x, weight, eps, cast):
    refuse_forward_ad("dsnorm::rms_norm", x, weight)
    out = (lane or _load_lane())(LANE_PLAIN, x, None, weight, eps, cast, None, None)
    if out is not None:
        return out
    return _plain(x, weight, eps, cast, False)[0]


def rms_norm_fwd(x, weight, eps, cast):
    refuse_forward_ad("dsnorm::rms_norm_fwd", x, weight)
    return _plain(x, weight, eps, cast, True)


def fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    refuse_forward_ad("dsnorm::fused_add_rms_norm", x, residual, weight)
    out = (lane or _load_lane())(LANE_FUSED, x, residual, weight, eps, cast, residual_rounding, residual_dtype)
    if out is not None:
        return out
    return _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, False)[:2]


def fused_add_rms_norm_fwd(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    refuse_forward_ad("dsnorm::fused_add_rms_norm_fwd", x, residual, weight)
    return _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)


def check_inplace(x, residual) -> None:
    """In place, the residual buffer's own dtype decides the stream: x.dtype, or fp32."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    check_inplace_residual(residual, x)
    for name, t in (("x", x), ("residual", residual)):
        if not rows_viewable(t):
            raise ValueError(
                f"{name} must have unit-stride rows with one stride between them to be written in place, "
                f"got shape {tuple(t.shape)} and strides {t.stride()}"
            )
    for name, t in (("x", x), ("residual", residual)):
        # Rows that share memory (an expanded or overlapping view) would be written twice.
        if _rows_overlap(t):
            raise ValueError(f"{name} has elements that share memory (an expanded or overlapping view); "
                             "it cannot be written in place")
    if _overlaps(x, residual):
        raise ValueError("x and residual must not share memory in the in-place form")


def check_inplace_weight(weight, x, residual) -> None:
    """The kernel reads the weight while it writes x and residual (torch's in-place ops refuse the
    same: ``a.mul_(a[0])``)."""
    for name, t in (("x", x), ("residual", residual)):
        if _overlaps(t, weight):
            raise ValueError(f"weight must not share memory with {name} in the in-place form (it is read "
                             f"while {name} is written); pass weight.clone()")


def _rows_overlap(t: torch.Tensor) -> bool:
    """Whether two rows of a rows-viewable tensor share memory (a row stride below the width)."""
    n = t.shape[-1]
    if t.numel() <= n:
        return False
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1:
            return stride < n
    return False


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    # By address, not by storage: two storages can hold the same memory (torch.from_numpy of two
    # views of one array, DLPack, frombuffer), and the kernel writes x while it reads residual.
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = address_range(a)
    b0, b1 = address_range(b)
    return a0 < b1 and b0 < a1 and not _rows_interleave(a, b)


def address_range(t: torch.Tensor) -> tuple:
    """The bytes ``[start, end)`` a strided, non-empty tensor's elements lie in."""
    start = t.data_ptr()
    return start, start + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _rows_interleave(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two rows-viewable tensors whose address ranges overlap still share no element: ``b``'s
    rows lie in the gaps between ``a``'s, at one common row stride in bytes (``buf[:, :n]`` and
    ``buf[:, n:]`` of one ``[rows, 2n]`` buffer), or ``b`` is 1-D and lies in one gap (a weight,
    ``buf[0, 2n:]`` beside ``buf[:, :n]``)."""
    if not (rows_viewable(a) and rows_viewable(b)) or a.dim() < 2:
        return False
    stride = row_stride(a) * a.element_size()
    if stride <= 0 or (b.dim() >= 2 and stride != row_stride(b) * b.element_size()) or b.dim() == 0:
        return False
    width_a, width_b = a.shape[-1] * a.element_size(), b.shape[-1] * b.element_size()
    offset = (b.data_ptr() - a.data_ptr()) % stride  # where b's rows start within a's row period
    return width_a <= offset and offset + width_b <= stride


def _inplace_common_case(x, residual, weight) -> bool:
    """What check_input, check_weight, check_inplace and check_inplace_weight would prove, for
    contiguous same-dtype rows and an fp32 weight in separate memory, in a few attribute reads."""
    if not (_common_case(x, weight) and isinstance(residual, torch.Tensor)):
        return False
    if residual.dtype is not x.dtype or residual.shape != x.shape or residual.is_cpu is not x.is_cpu:
        return False
    if not (x.is_cpu and x.is_contiguous() and residual.is_contiguous()):
        return False
    a, b, w = x.data_ptr(), residual.data_ptr(), weight.data_ptr()
    nbytes = x.numel() * x.element_size()
    w_end = w + weight.numel() * weight.element_size()
    return ((a + nbytes <= b or b + nbytes <= a) and (w_end <= a or a + nbytes <= w)
            and (w_end <= b or b + nbytes <= w))


def refuse_inference_write(x, residual) -> None:
    """torch's rule for in-place ops: an inference tensor (made under ``torch.inference_mode``) is
    written only inside inference mode."""
    if torch.is_inference_mode_enabled():
        return
    for name, t in (("x", x), ("residual", residual)):
        if isinstance(t, torch.Tensor) and t.is_inference():
            raise RuntimeError(
                f"{name} is an inference tensor (made under torch.inference_mode) and cannot be written in "
                f"place outside inference mode; call fused_add_rms_norm_ under torch.inference_mode(), pass "
                f"{name}.clone(), or use fused_add_rms_norm"
            )


def fused_add_rms_norm_inplace(x, residual, weight, eps, cast, residual_rounding):
    refuse_forward_ad("dsnorm::fused_add_rms_norm_", x, residual, weight)
    refuse_inference_write(x, residual)
    if (lane or _load_lane())(LANE_INPLACE, x, residual, weight, eps, cast, residual_rounding, None) is not None:
        return
    if not _inplace_common_case(x, residual, weight):
        check_input(x)
        check_inplace(x, residual)
        check_weight(weight, x)
        check_inplace_weight(weight, x, residual)
    check_inplace_options(eps, cast, residual_rounding, x, residual)
    _launcher(x).forward(
        x, residual, weight, eps, cast == "hf", residual_rounding == "round_first", x, residual, None
    )


def _check_like(t, name, x, dtypes, shape=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = tuple(x.shape) if shape is None else tuple(shape)
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")


def check_backward(dy, x, weight, rstd, residual=None, dresidual_out=None) -> None:
    """The backward ops read raw rows: every tensor's shape, dtype and device against x's."""
    check_input(x)
    check_weight(weight, x)
    _check_like(dy, "dy", x, (x.dtype,))
    _check_like(rstd, "rstd", x, (compute_dtype(x.dtype),), x.shape[:-1])
    if residual is not None:
        check_residual(residual, x, torch.float32)
    if dresidual_out is not None:
        _check_like(dresidual_out, "dresidual_out", x, tuple(dict.fromkeys((x.dtype, torch.float32))))


# What check_backward accepts as the residual beside each x dtype (either residual_dtype).
_BACKWARD_RESIDUALS = {d: residual_dtypes(d, torch.float32) for d in (torch.float64, *_WIDENED_RESIDUALS)}


def backward_inputs_match(dy, x, weight, rstd, residual=None, dresidual_out=None) -> bool:
    """What the kernels rely on of check_backward's rules, as one cheap predicate (~1.5 us against
    ~4), for inputs that passed the forward's checks: shapes, dtypes and devices against dy's, and
    a unit-stride weight."""
    shape, device = dy.shape, dy.get_device()
    return (x.shape == shape and x.dtype == dy.dtype and weight.shape == shape[-1:] and rstd.shape == shape[:-1]
            and weight.dtype == rstd.dtype == compute_dtype(x.dtype) and weight.is_contiguous()
            and x.get_device() == weight.get_device() == rstd.get_device() == device
            and (residual is None or (residual.shape == shape and residual.get_device() == device
                                      and residual.dtype in _BACKWARD_RESIDUALS.get(x.dtype, ())))
            and (dresidual_out is None or (dresidual_out.shape == shape and dresidual_out.get_device() == device
                                           and dresidual_out.dtype in (x.dtype, torch.float32))))


def rms_norm_bwd(dy, x, weight, rstd):
    check_backward(dy, x, weight, rstd)
    return rms_norm_bwd_unchecked(dy, x, weight, rstd)


def fused_add_rms_norm_bwd(dy, x, residual, weight, rstd, dresidual_out, residual_rounding):
    check_backward(dy, x, weight, rstd, residual, dresidual_out)
    check_options(1.0, "deepseek", residual_rounding)
    return fused_add_rms_norm_bwd_unchecked(dy, x, residual, weight, rstd, dresidual_out,
                                            residual_rounding == "round_first")


# The backward ops' bodies without their checks, for the autograd Functions' direct calls: the
# saved tensors passed the forward op's checks (the Functions test them with
# backward_inputs_match, in case they were replaced since), and autograd hands in output gradients of the
# outputs' shape, dtype and device (it casts a gradient of another dtype, refuses another shape
# or device). The checks cost ~4 us a fused call on the CI machine, ~5x that on a GPU host.


def rms_norm_bwd_unchecked(dy, x, weight, rstd):
    rstd = rstd.contiguous()  # the kernels read it as one value per row, unit stride
    x = readable_rows(x)
    launcher = _launcher(x)
    dx = launcher.empty_output(x, x.dtype)
    dweight = torch.empty_like(weight)
    launcher.backward(readable_rows(dy), x, None, weight, rstd, None, False, dx, None, dweight)
    return dx, dweight


def fused_add_rms_norm_bwd_unchecked(dy, x, residual, weight, rstd, dresidual_out, round_first: bool,
                                     write_dresidual: bool = True):
    """``write_dresidual=False`` (a residual in x's dtype only): dresidual comes back None, its
    values being dx's, and the kernels write one ``[rows, n]`` stream less."""
    rstd = rstd.contiguous()  # the kernels read it as one value per row, unit stride
    x = readable_rows(x)
    residual = readable_rows(residual)
    launcher = _launcher(x)
    dx = launcher.empty_output(x, x.dtype)
    dresidual = launcher.empty_output(residual, residual.dtype) if write_dresidual else None
    dweight = torch.empty_like(weight)
    launcher.backward(
        readable_rows(dy), x, residual, weight, rstd,
        None if dresidual_out is None else readable_rows(dresidual_out), round_first,
        dx, dresidual, dweight,
    )
    return dx, dresidual, dweight


for _key in ("CPU", "CUDA"):
    lib.impl("rms_norm", rms_norm, _key)
    lib.impl("fused_add_rms_norm", fused_add_rms_norm, _key)
    lib.impl("rms_norm_fwd", rms_norm_fwd, _key)
    lib.impl("fused_add_rms_norm_fwd", fused_add_rms_norm_fwd, _key)
    lib.impl("fused_add_rms_norm_", fused_add_rms_norm_inplace, _key)
    lib.impl("rms_norm_bwd", rms_norm_bwd, _key)
    lib.impl("fused_add_rms_norm_bwd", fused_add_rms_norm_bwd, _key)

def _joined(names) -> str:
    return " and ".join(names) if len(names) <= 2 else f"{', '.join(names[:-1])} and {names[-1]}"


def refuse_inplace_grad(x, residual, weight) -> None:
    """The in-place form has no derivative: in grad mode, an input that requires grad (a leaf, or a
    tensor inside a live graph) is refused, as torch's own in-place ops refuse a leaf, naming it."""
    if not torch.is_grad_enabled():
        return
    names = [n for n, t in (("x", x), ("residual", residual), ("weight", weight))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if names:
        raise RuntimeError(
            f"fused_add_rms_norm_ writes its inputs and has no gradient, but {_joined(names)} "
            f"require{'s' if len(names) == 1 else ''} grad; use fused_add_rms_norm for training or call it "
            "under torch.no_grad()"
        )


def _inplace_autograd(keyset, x, residual, weight, eps, cast, residual_rounding):
    """The in-place op's Autograd kernel: it has no derivative (see refuse_inplace_grad)."""
    refuse_inplace_grad(x, residual, weight)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.dsnorm.fused_add_rms_norm_.default.redispatch(
            keyset & torch._C._after_autograd_keyset, x, residual, weight, eps, cast, residual_rounding
        )


def _inplace_version_bump(keyset, x, residual, weight, eps, cast, residual_rounding):
    """The in-place op's ADInplaceOrView kernel: what torch's in-place ops do there, bump the
    written tensors' version counters, so that a tensor autograd saved before the write fails its
    saved-tensor check at backward instead of giving wrong gradients."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        torch.ops.dsnorm.fused_add_rms_norm_.default.redispatch(
            keyset & torch._C._after_ADInplaceOrView_keyset, x, residual, weight, eps, cast, residual_rounding
        )
    torch._C._increment_version((x, residual))


lib.impl("fused_add_rms_norm_", _inplace_autograd, "Autograd", with_keyset=True)
lib.impl("fused_add_rms_norm_", _inplace_version_bump, "ADInplaceOrView", with_keyset=True)


# ---------------------------------------------------------------------------------------------
# Fake impls: shapes and dtypes only, after the same checks.


@torch.library.register_fake("dsnorm::rms_norm_fwd", lib=lib)
def _rms_norm_fwd_fake(x, weight, eps, cast):
    check_input(x)
    check_weight(weight, x)
    check_options(eps, cast)
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rstd_like(x)


@torch.library.register_fake("dsnorm::rms_norm", lib=lib)
def _rms_norm_fake(x, weight, eps, cast):
    return _rms_norm_fwd_fake(x, weight, eps, cast)[0]


@torch.library.register_fake("dsnorm::fused_add_rms_norm_fwd", lib=lib)
def _fused_fwd_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    # The real op's order (_fused), so that a call with two faults names the same one in both.
    check_input(x)
    check_weight(weight, x)
    check_residual(residual, x, residual_dtype)
    check_options(eps, cast, residual_rounding, residual_dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x, dtype=residual_dtype or x.dtype, memory_format=torch.contiguous_format)
    return y, residual_out, _rstd_like(x)


@torch.library.register_fake("dsnorm::fused_add_rms_norm", lib=lib)
def _fused_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    return _fused_fwd_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype)[:2]


@torch.library.register_fake("dsnorm::fused_add_rms_norm_", lib=lib)
def _fused_inplace_fake(x, residual, weight, eps, cast, residual_rounding):
    check_input(x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    check_inplace_residual(residual, x)
    check_weight(weight, x)
    check_inplace_options(eps, cast, residual_rounding, x, residual)
    if torch._C._is_alias_of(x, residual):
        # Eager code takes two views of one buffer that share no element (buf[:, :n], buf[:, n:]);
        # compiled code with dynamic shapes rebuilds them from one base and loses the residual's
        # offset (torch 2.13; a plain torch.library.custom_op fails the same way), writing
        # norm(x + x). Refused under tracing rather than wrong.
        raise ValueError(
            "x and residual are views of one buffer: under torch.compile (and other tracing) the in-place "
            "form needs them in separate buffers; pass separate tensors, or call it eagerly"
        )
    return None


@torch.library.register_fake("dsnorm::rms_norm_bwd", lib=lib)
def _rms_norm_bwd_fake(dy, x, weight, rstd):
    check_backward(dy, x, weight, rstd)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@torch.library.register_fake("dsnorm::fused_add_rms_norm_bwd", lib=lib)
def _fused_bwd_fake(dy, x, residual, weight, rstd, dresidual_out, residual_rounding):
    check_backward(dy, x, weight, rstd, residual, dresidual_out)
    check_options(1.0, "deepseek", residual_rounding)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(residual, memory_format=torch.contiguous_format),
        torch.empty_like(weight),
    )
