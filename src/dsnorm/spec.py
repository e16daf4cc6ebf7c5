"""What each form accepts: one specification, read by the checks that raise and by the fast paths.

The forms (:class:`Form`): plain ``rms_norm``, the fused ``fused_add_rms_norm`` and the in-place
``fused_add_rms_norm_``; the backward ops take what the forward saved. Each rule lives here once:
the tables (dtypes, options, residual dtypes, eps bounds), the ``check_*`` functions that raise
an error naming the argument, and the common-case predicates the fast paths use instead of the
checks (``common_case``, ``inplace_common_case``, ``train_lane_*``, ``backward_inputs_match``),
each written from the same tables and proving a subset of what the checks accept. The CPU lane
(:func:`dsnorm.cpu.lane.lane`) reads the tables too; a rule changes here, in one place.
"""

from __future__ import annotations

import enum
import math
import numbers

import torch

from dsnorm.dispatch import _is_compiling, _transforms_active, dispatch_free, plain_memory
from dsnorm.ref import CASTS, RESIDUAL_ROUNDINGS, compute_dtype
from dsnorm.rows import _overlaps, _rows_overlap, rows_viewable


class Form(enum.IntEnum):
    """The forward forms a fast path is asked about: ``PLAIN`` (``y``), ``FUSED`` (``(y,
    residual_out)``) and ``INPLACE`` (written into ``x`` and ``residual``)."""

    PLAIN = 0
    FUSED = 1
    INPLACE = 2


INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The options as the kernels take them: ``cast == "hf"`` and ``residual_rounding == "round_first"``.
CAST_HF = {cast: cast == "hf" for cast in CASTS}
ROUND_FIRST = {rounding: rounding == "round_first" for rounding in RESIDUAL_ROUNDINGS}

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
WIDENED_RESIDUALS = (torch.float32, torch.bfloat16, torch.float16)


def residual_dtypes(x_dtype: torch.dtype, residual_dtype, mixed: bool = True) -> tuple:
    """The residual dtypes accepted beside an x of ``x_dtype`` (x's own first). ``mixed=False``:
    x.dtype, or also float32 with ``residual_dtype=torch.float32`` (the in-place form, whose
    residual buffer is also its output, and the fusions)."""
    if mixed and x_dtype in WIDENED_RESIDUALS:
        return (x_dtype,) + tuple(d for d in WIDENED_RESIDUALS if d is not x_dtype)
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


# ---------------------------------------------------------------------------------------------
# The common case, proved in a few attribute reads instead of the checks above (each predicate
# accepts a subset of what they accept; anything else goes through them and their messages).

_COMPUTE_DTYPE = {d: compute_dtype(d) for d in INPUT_DTYPES}
_STRIDED = torch.strided


def common_case(x, weight) -> bool:
    """What check_input and check_weight would prove, for the common case."""
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


def _same_residual(residual, x) -> bool:
    """A residual tensor of x's dtype, shape and device: what check_residual would prove of it, but
    that it is dense (the callers know that, or find out)."""
    return (residual.dtype is x.dtype and residual.shape == x.shape
            and (residual.is_cpu if x.is_cpu else residual.device == x.device))


# The training forward's lane (dsnorm.autograd): its common case proved in one expression, in place
# of the public function's argument checks and row handling (autograd._rows, _savable), the
# Function's probe (autograd._direct) and the forward op's checks (check_input, check_weight,
# check_residual, check_options, readable_rows). It holds for plain tensors whose rows the kernels
# read in place (contiguous, or strided rows such as kv_norm's 512-of-576 slice) on the CPU or on
# x's CUDA device, outside every transform, trace, mode and profiler, with options an earlier call
# has checked (residual_dtype None); anything else takes those checks and their messages.
# ``weight``: the compute-dtype gain (autograd._compute_weight's).
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
        and common_case(x, weight) and not weight.is_nested
        and (x.is_contiguous() or rows_viewable(x))
        and not x.is_inference() and not weight.is_inference()
    ):
        return False
    return residual is None or (
        plain_memory(residual) and residual.layout is _STRIDED and not residual.is_nested
        and _same_residual(residual, x)
        and (residual.is_contiguous() or rows_viewable(residual)) and not residual.is_inference()
    )


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


def inplace_common_case(x, residual, weight) -> bool:
    """What check_input, check_weight, check_inplace and check_inplace_weight would prove, for
    contiguous same-dtype CPU rows and an fp32 weight in separate memory, in a few attribute reads."""
    if not (common_case(x, weight) and isinstance(residual, torch.Tensor) and _same_residual(residual, x)):
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
_BACKWARD_RESIDUALS = {d: residual_dtypes(d, torch.float32) for d in (torch.float64, *WIDENED_RESIDUALS)}


def backward_inputs_match(dy, x, weight, rstd, residual=None, dresidual_out=None) -> bool:
    """What the kernels rely on of check_backward's rules, as one cheap predicate (a third of the
    checks' cost), for inputs that passed the forward's checks: shapes, dtypes and devices against
    dy's, and a unit-stride weight."""
    shape, device = dy.shape, dy.get_device()
    return (x.shape == shape and x.dtype == dy.dtype and weight.shape == shape[-1:] and rstd.shape == shape[:-1]
            and weight.dtype == rstd.dtype == compute_dtype(x.dtype) and weight.is_contiguous()
            and x.get_device() == weight.get_device() == rstd.get_device() == device
            and (residual is None or (residual.shape == shape and residual.get_device() == device
                                      and residual.dtype in _BACKWARD_RESIDUALS.get(x.dtype, ())))
            and (dresidual_out is None or (dresidual_out.shape == shape and dresidual_out.get_device() == device
                                           and dresidual_out.dtype in (x.dtype, torch.float32))))


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

