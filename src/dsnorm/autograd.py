"""Autograd Functions over the custom ops, and the functional API.

``y = weight * s / sqrt(mean(s^2) + eps)`` with ``s = x`` (or ``x + residual``), computed in fp32
(fp64 for fp64 inputs) and cast once to ``x.dtype``. Gradients are those of that formula (the
``"hf"`` and ``"round_first"`` roundings pass gradients straight through).

When no gradient is needed the functions skip the Function (nothing is saved), and in plain
eager code they, and the Functions' forward and backward, call the op's implementation directly: at
decode sizes the dispatcher's round trip costs more than the norm. The op itself is used whenever
anything could observe the difference: torch.compile tracing, tensor subclasses (DTensor,
FakeTensor), functorch transforms, and torch function or dispatch modes (CommDebugMode,
FlopCounterMode...). In grad mode the common case (plain
contiguous tensors, options checked before) takes a training lane: one proof of what the checks
would establish (``spec.train_lane_plain`` / ``train_lane_fused``), then the same Function, told by
its ``checked`` argument to skip them.

Each function tries the CPU fast lane (``ops.lane``) once, first; when it declines, the rest of the
function (``_rms_norm`` and friends, which the module calls too after its own attempt) never tries
it again: it calls the ops' ``*_checked`` impls.
"""

from __future__ import annotations

from typing import Optional

import torch

from dsnorm import ops
from dsnorm.ref import EPS, compute_dtype
from dsnorm.dispatch import (
    _is_compiling,
    _is_wrapped,
    _transforms_active,
    dispatch_free,
    is_dtensor,
    plain_memory,
    refuse_forward_ad,
)
from dsnorm.rows import readable_rows
from dsnorm.spec import (
    INPUT_DTYPES,
    Form,
    backward_inputs_match,
    check_backward,
    check_dense,
    check_input,
    check_residual,
    refuse_inplace_grad,
)

_PLAIN, _FUSED, _INPLACE = Form.PLAIN, Form.FUSED, Form.INPLACE

_infer = torch.ops.dsnorm.rms_norm
_fused_infer = torch.ops.dsnorm.fused_add_rms_norm
_fwd = torch.ops.dsnorm.rms_norm_fwd
_fused_fwd = torch.ops.dsnorm.fused_add_rms_norm_fwd
_fused_inplace = torch.ops.dsnorm.fused_add_rms_norm_
_bwd = torch.ops.dsnorm.rms_norm_bwd
_fused_bwd = torch.ops.dsnorm.fused_add_rms_norm_bwd


class _NoSecondDerivative(torch.autograd.Function):
    """Identity on the first-order gradients whose backward refuses by name. Its inputs include the
    tensors the gradients are functions of (output gradients and saved inputs), so any second
    derivative, by .backward() or autograd.grad(inputs=...), passes through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(what, n, *tensors):
        return tuple(t.clone() for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.what = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"dsnorm.{ctx.what} has no second derivative (double backward through its gradients); use "
            "dsnorm.RMSNormRef (the eager reference) where second derivatives are needed")


def _first_order_only(what: str, grads: tuple, depends_on: tuple) -> tuple:
    anchors = [t for t in depends_on if isinstance(t, torch.Tensor) and t.requires_grad]
    if not torch.is_grad_enabled() or not anchors:
        return grads
    live = [i for i, g in enumerate(grads) if g is not None]
    fenced = _NoSecondDerivative.apply(what, len(live), *(grads[i] for i in live), *anchors)
    out = list(grads)
    for i, g in zip(live, fenced):
        out[i] = g
    return tuple(out)


# The autograd formulas, shared by the Functions below and by the forward ops' own registration
# (``register_autograd``, for torch.jit.trace); ``what`` names the route in the second-derivative error.


# Both setups turn off the materialisation of undefined output gradients: autograd would otherwise
# hand the backward a zero tensor, filled by a kernel of its own, for rstd (never differentiable)
# on every call, and for residual_out wherever the new residual stream is not used (the final
# norm's); the kernels then also read those zeros back (one [rows, n] stream more).


# In plain eager code the backwards call the kernels without the backward ops' checks (see
# ops.rms_norm_bwd_unchecked). The saved tensors passed
# the forward's checks, but can be other tensors by now: a saved-tensor hook's unpack, or an
# input's .data reassigned (which bumps no version). backward_inputs_match compares them with
# dy (which autograd has matched to y); on a mismatch the op's checks name it. Under
# torch.compile the backward is the op's.


def _plain_setup(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


# Output gradients batched by torch.autograd.grad(..., is_grads_batched=True) (legacy vmap, which
# torch.autograd.functional.jacobian(vectorize=True) uses) have no storage: they take the op,
# whose legacy batching fallback runs it per sample. Only output gradients can be such tensors.
# (Probed after _direct, which is False while dynamo traces: dynamo cannot trace the probe.)
_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def _dense(grad):
    """An output gradient as dense rows: autograd also passes on sparse ones (``y.backward(g)``
    with a sparse ``g``), which the kernels cannot read and ``contiguous()`` refuses. (Dynamo
    refuses to read ``layout`` in a Function's backward; compiled graphs take the op.)"""
    if _is_compiling() or grad.layout is torch.strided:
        return grad.contiguous()
    return grad.to_dense().contiguous()


def _plain_backward(what, ctx, dy_in):
    x, weight, rstd = ctx.saved_tensors
    if not torch.is_grad_enabled():  # a plain backward (no create_graph): nothing to record or fence
        return (*_plain_grads(dy_in, x, weight, rstd), None, None)
    with torch.no_grad():
        grads = _plain_grads(dy_in, x, weight, rstd)
    return (*_first_order_only(what, grads, (dy_in, x, weight)), None, None)


def _plain_grads(dy_in, x, weight, rstd):
    dy = torch.zeros_like(x) if dy_in is None else _dense(dy_in)
    if _direct(dy, x, weight, rstd) and not _legacy_batched(dy):
        if not backward_inputs_match(dy, x, weight, rstd):
            check_backward(dy, x, weight, rstd)
        return ops.rms_norm_bwd_unchecked(dy, x, weight, rstd)
    return _bwd(dy, x, weight, rstd)


# The gradient of s = x + residual is one tensor for both inputs. It is written once and handed to
# both (one [rows, n] stream less for the kernels) only where the residual is another fused
# norm's residual_out (or y), as in every block of DeepSeek's model but the first: its gradient then
# goes into that norm's backward, which reads it and lets it go, so no two .grad tensors share
# memory (retain_grad copies; autograd.grad asked for both inputs, or a hook on the residual, sees
# the one tensor, as for PyTorch's own addition). Anywhere else both are written: autograd can
# store two views of one gradient as two leaves' .grad, which in-place updates (accumulation,
# clipping, zero_) then corrupt (pytorch#34082; PyTorch's own x + residual is subject to it).


def _fused_setup(ctx, inputs, output):
    x, residual, weight = inputs[:3]
    residual_rounding = inputs[5]
    ctx.save_for_backward(x, residual, weight, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.residual_rounding = residual_rounding
    # (Dynamo would not trace the probe; the compiled backward calls the op.)
    ctx.share_dresidual = (not _is_compiling() and residual.dtype == x.dtype
                           and type(residual.grad_fn) is _FUSED_NODE)


def _fused_backward(what, ctx, dy, dresidual_out):
    x, residual, weight, rstd = ctx.saved_tensors
    if not torch.is_grad_enabled():  # a plain backward (no create_graph): nothing to record or fence
        return (*_fused_grads(ctx, dy, dresidual_out, x, residual, weight, rstd), None, None, None, None)
    with torch.no_grad():
        grads = _fused_grads(ctx, dy, dresidual_out, x, residual, weight, rstd)
    incoming = (dy, dresidual_out, x, residual, weight)
    return (*_first_order_only(what, grads, incoming), None, None, None, None)


def _fused_grads(ctx, dy_in, dresidual_out, x, residual, weight, rstd):
    dro = None if dresidual_out is None else _dense(dresidual_out)
    if dy_in is None:
        # y unused (only the new residual stream is): as in the reference's graph, the gradient
        # reaches x and residual through s = x + residual alone, widened and rounded to each one's
        # dtype, and the weight gets none (its .grad stays None, where a zero gradient would still
        # move it under weight decay); nothing passes through the norm, whose xhat * 0 would be NaN
        # for an infinite s.
        if dro is None:
            return None, None, None
        dx = dro.to(x.dtype, copy=True)
        return dx, dx if ctx.share_dresidual else dro.to(residual.dtype, copy=True), None
    dy = _dense(dy_in)
    if (_direct(dy, x, residual, weight, rstd, *(() if dro is None else (dro,)))
            and not (_legacy_batched(dy) or (dro is not None and _legacy_batched(dro)))):
        if not backward_inputs_match(dy, x, weight, rstd, residual, dro):
            check_backward(dy, x, weight, rstd, residual, dro)
        dx, dresidual, dweight = ops.fused_add_rms_norm_bwd_unchecked(
            dy, x, residual, weight, rstd, dro, ctx.residual_rounding == "round_first", not ctx.share_dresidual)
        return dx, dx if dresidual is None else dresidual, dweight
    return _fused_bwd(dy, x, residual, weight, rstd, dro, ctx.residual_rounding)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` on ``[..., n]`` input; weight in the compute dtype. Returns ``(y, rstd)``
    (``rstd`` not differentiable). New-style (forward without ctx, ``setup_context``) so that
    ``torch.func`` transforms work: vmap through the ops (``generate_vmap_rule``), grad, jacrev.
    ``checked``: the arguments passed the training lane's proof (``spec.train_lane_plain``), so the
    forward skips the checks; an argument, not state, so that one Function class (one grad_fn, one
    compiled-autograd node) serves both paths."""

    generate_vmap_rule = True
    setup_context = staticmethod(_plain_setup)

    @staticmethod
    def forward(x, weight, eps, cast, checked):
        if checked:
            return ops.rms_norm_fwd_unchecked(x, weight, eps, cast)
        return (ops.rms_norm_fwd if _direct(x, weight) else _fwd)(x, weight, eps, cast)

    @staticmethod
    def backward(ctx, dy, _drstd):
        return (*_plain_backward("rms_norm", ctx, dy), None)


class FusedAddRMSNormFunction(torch.autograd.Function):
    """``fused_add_rms_norm`` on ``[..., n]`` inputs; weight in the compute dtype. Returns
    ``(y, residual_out, rstd)`` (``rstd`` not differentiable); new-style, as RMSNormFunction
    (``checked``: proved by ``spec.train_lane_fused``)."""

    generate_vmap_rule = True
    setup_context = staticmethod(_fused_setup)

    @staticmethod
    def forward(x, residual, weight, eps, cast, residual_rounding, residual_dtype, checked):
        if checked:
            return ops.fused_add_rms_norm_fwd_unchecked(x, residual, weight, eps, cast, residual_rounding,
                                                        residual_dtype)
        fwd = ops.fused_add_rms_norm_fwd if _direct(x, residual, weight) else _fused_fwd
        return fwd(x, residual, weight, eps, cast, residual_rounding, residual_dtype)

    @staticmethod
    def backward(ctx, dy, dresidual_out, _drstd):
        return (*_fused_backward("fused_add_rms_norm", ctx, dy, dresidual_out), None)


# The autograd node of a FusedAddRMSNormFunction output (see _fused_setup).
_FUSED_NODE = FusedAddRMSNormFunction._backward_cls

# torch.jit.trace: the forward ops carry their own autograd formula (the same), and while tracing
# the functions call them whether or not a gradient is needed. The Functions above would record a
# Python op (not serialisable by torch.jit.save) in grad mode and the plain op under no_grad, where
# jit.trace's check re-runs the model: "Graphs differed across invocations".
_jit_tracing = torch._C._get_tracing_state
# The public functions read ops.lane only when dynamo is not tracing (_is_compiling): dynamo would
# guard on the lane being unloaded, and the compiled graph's own op call loads it, so the second
# call would recompile (and raise under torch.compiler.set_stance("fail_on_recompile")). Dynamo
# folds that call to True without a guard.
torch.library.register_autograd(
    "dsnorm::rms_norm_fwd", lambda ctx, dy, _drstd: _plain_backward("rms_norm_fwd", ctx, dy),
    setup_context=_plain_setup, lib=ops.lib)
torch.library.register_autograd(
    "dsnorm::fused_add_rms_norm_fwd",
    lambda ctx, dy, dresidual_out, _drstd: _fused_backward("fused_add_rms_norm_fwd", ctx, dy, dresidual_out),
    setup_context=_fused_setup, lib=ops.lib)

# torch.autograd.graph.increment_version without its Python wrapper (this runs per decode call).
_increment_version = torch._C._increment_version


def _direct(*tensors) -> bool:
    """True when calling the op's implementation directly is indistinguishable from the op."""
    if not dispatch_free():
        return False
    for t in tensors:
        if not plain_memory(t):
            return False
    return True


# Function.apply (torch <= 2.13) binds its arguments to forward's signature with inspect whenever
# setup_context is defined, only to fill in defaults: the largest single host cost of a training
# step's norm. These forwards
# have no defaults and are called positionally, so outside functorch transforms, with no tensor
# left over from one (apply unwraps those), the C apply it ends in is the same call (from torch
# 2.14 Function.apply is that C apply itself).
_c_apply = torch._C._FunctionBase.__dict__["apply"]


def _apply(function, *args):
    """``function.apply(*args)`` (positional arguments only) without the signature binding (dynamo
    traces only ``apply`` itself: it is what compiled code calls)."""
    if _is_compiling():
        return function.apply(*_distinct_tensors(args))
    if _transforms_active():
        return function.apply(*args)
    for a in args:
        if isinstance(a, torch.Tensor) and _is_wrapped(a):
            return function.apply(*args)
    return _c_apply.__get__(None, function)(*args)


def _distinct_tensors(args: tuple) -> tuple:
    """``args`` with each repeat of a tensor (``norm(h, h)``) replaced by a view of it: dynamo
    refuses an autograd.Function handed one tensor twice ("duplicate tensor input"), which eager
    code and the reference take. A view has the same values, and its gradient reaches the tensor."""
    seen = []
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if any(a is b for b in seen):
                a = a.view_as(a)
            else:
                seen.append(a)
        out.append(a)
    return tuple(out)


# The Functions' C apply, bound once, for the training lane (its arguments are plain tensors outside
# every transform: what _apply checks).
_plain_lane = _c_apply.__get__(None, RMSNormFunction)
_fused_lane = _c_apply.__get__(None, FusedAddRMSNormFunction)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _compute_weight(weight: torch.Tensor, x: torch.Tensor, name: str = "weight", x_name: str = "x") -> torch.Tensor:
    # bf16/fp16 gains widen exactly; the cast is differentiable, so dweight comes back in the
    # weight's own dtype. ``name`` / ``x_name``: the caller's argument names, for the errors.
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{x_name} must be a torch.Tensor, got {type(x).__name__}")
    if weight.layout is not torch.strided:
        check_dense(weight, name)
    # The kernels read the gain with unit stride: a strided or expanded one is copied (it is small).
    wdtype = weight.dtype
    # A ZeroTensor has no memory (the dispatcher would hand the op an expanded zero); the probe is
    # eager-only: dynamo cannot trace it, and compiled graphs materialise zero tensors themselves.
    if not _is_compiling() and weight._is_zerotensor():
        weight = weight.clone()  # materialised zeros, still differentiable
    if wdtype is torch.float32 and x.dtype is not torch.float64:  # the common case, in three reads
        return weight if weight.is_contiguous() else weight.contiguous()
    if wdtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {wdtype}")
    cdtype = compute_dtype(x.dtype) if x.dtype in INPUT_DTYPES else torch.float32
    if wdtype == cdtype:
        return weight.contiguous()
    if is_dtensor(weight):
        return _WidenDTensorGain.apply(weight, cdtype).contiguous()
    return weight.to(cdtype).contiguous()


class _WidenDTensorGain(torch.autograd.Function):
    """``weight.to(dtype)`` for a DTensor gain narrower than the compute dtype, whose backward sums
    the ranks' parts of ``dweight`` (a ``Partial`` where ``x`` is sharded) in the compute dtype
    before rounding to the gain's dtype, once, as one process does. DTensor's own backward of the
    cast would round each rank's part to bf16 first and add them in bf16 (ulps off the
    one-process gradient). Costs an all-reduce of the ``[d]`` gradient
    in each backward (with gradient accumulation, one per micro-batch where a ``Partial`` would be
    reduced once per step)."""

    @staticmethod
    def forward(ctx, weight, dtype):
        ctx.weight_dtype = weight.dtype
        return weight.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if is_dtensor(grad):
            from torch.distributed.tensor import Replicate

            # Unconditionally (a no-op for a replicated gradient): under torch.compile the traced
            # gradient carries the forward output's placement (Replicate), not the Partial it has
            # at run time, so a test of its placements would drop the reduction from the graph.
            grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
        return grad.to(ctx.weight_dtype), None


def _savable(t):
    """``t``, or a copy when it is an inference tensor (made under ``torch.inference_mode``, e.g. a
    cached batch, or a weight of a model built there): the Functions save their inputs for the
    backward, and autograd cannot save those (the copy passes the gradient on to ``t``).
    (Dynamo cannot trace ``is_inference()``; a compiled graph saves through AOTAutograd instead.)"""
    return t.clone() if not _is_compiling() and t.is_inference() else t


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` checked, as the Function takes it: rows the kernels can read in place (a copy only if
    its leading dims do not collapse to one row stride), in ``t``'s own shape.

    Not flattened to 2-D: the ops and launchers take any leading shape, and each flattening view
    (of x and the residual in, of y and residual_out out) is a node of the autograd graph, a
    fifth of a 3-D training step's host time. Tensor subclasses (DTensor) pass
    as they are: flattening a DTensor sharded on a row dim would be a redistribution.
    """
    check_input(t, name)
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return t
    return readable_rows(t)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS, *, cast: str = "deepseek") -> torch.Tensor:
    """``y = (weight * (x * rsqrt(mean(x^2, -1) + eps))).to(x.dtype)``, computed in fp32.

    Args:
        x: ``[..., n]`` float32 / bfloat16 / float16 (float64 is computed in float64); rows may be
            strided (unit stride along the last dimension is read in place).
        weight: ``[n]`` gain; float32 is canonical, bf16/fp16 are widened exactly.
        eps: added to the mean square; > 0, with a nonzero finite float32 rounding (about 1.4e-45 to 3.4e38).
        cast: ``"deepseek"`` (reference: fp32 weight times fp32 x̂, one rounding) or ``"hf"``
            (Hugging Face: ``weight.to(x.dtype) * x̂.to(x.dtype)``).

    Returns:
        ``y``: ``[..., n]`` in ``x.dtype``, contiguous.
    """
    lane = None if _is_compiling() else ops.lane  # see _is_compiling's comment
    if lane is not None:
        y = lane(_PLAIN, x, None, weight, eps, cast, None, None, True)
        if y is not None:
            return y
    return _rms_norm(x, weight, eps, cast)


def _rms_norm(x, weight, eps, cast):
    """``rms_norm`` past the fast lane (tried by the caller, or not loaded yet)."""
    w = _compute_weight(weight, x)
    refuse_forward_ad("dsnorm.rms_norm", x, w)
    if _jit_tracing():
        return _fwd(x, w, eps, cast)[0]
    if not _needs_grad(x, w):
        if _direct(x, w):
            return ops.rms_norm_checked(x, w, eps, cast)
        return _infer(x, w, eps, cast)
    if ops.train_lane_plain(x, w, eps, cast):
        return _plain_lane(x, w, eps, cast, True)[0]
    return _apply(RMSNormFunction, _rows(_savable(x), "x"), _savable(w), eps, cast, False)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    *,
    cast: str = "deepseek",
    residual_rounding: str = "fp32_sum",
    residual_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x.float() + residual.float()``; ``y = (weight * (s * rsqrt(mean(s^2) + eps))).to(x.dtype)``.

    The norm is taken of the unrounded fp32 sum (DeepSeek's ``RMSNorm.forward(x, residual)``).

    Args:
        x: ``[..., n]`` float32 / bfloat16 / float16 / float64; the block's output.
        residual: ``[..., n]`` residual stream; bf16 / fp16 / fp32 beside such an ``x``, added
            widened as the reference's ``residual.float()`` (fp64 ``x``: fp64, or fp32 with
            ``residual_dtype=torch.float32``).
        weight: ``[n]`` gain (float32 canonical; bf16/fp16 widened exactly).
        eps: > 0, with a nonzero finite float32 rounding (about 1.4e-45 to 3.4e38).
        cast: ``"deepseek"`` or ``"hf"`` (see :func:`rms_norm`).
        residual_rounding: ``"fp32_sum"`` (reference: normalise the unrounded sum) or
            ``"round_first"`` (normalise ``s.to(x.dtype)``: the order of vLLM's CUDA kernel and
            Liger's fused add, not their bits; README's compatibility footnote).
        residual_dtype: ``None`` (residual returned in ``x.dtype``, whatever the residual's) or
            ``torch.float32`` (the residual stream kept in fp32; contradicts ``"round_first"``).

    Returns:
        ``(y, residual_out)``: ``y`` in ``x.dtype``; ``residual_out = s`` in ``residual_dtype``
        (``x.dtype`` by default), both fresh contiguous ``[..., n]`` tensors.

    Gradients: those of ``x`` and ``residual`` (both the gradient of ``s``, each in its own dtype)
    are one tensor, written once, in eager code where the residual is an output of another fused
    norm (its ``residual_out``, in a chain of blocks) in ``x.dtype``; elsewhere two tensors. With
    ``y`` unused, eager code gives the weight no gradient (``None``), as the reference does
    (under torch.compile zeros: the traced backward is handed a zero gradient for ``y``).
    """
    lane = None if _is_compiling() else ops.lane
    if lane is not None:
        out = lane(_FUSED, x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)
        if out is not None:
            return out
    return _fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype)


def _fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    """``fused_add_rms_norm`` past the fast lane (as ``_rms_norm``)."""
    w = _compute_weight(weight, x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    refuse_forward_ad("dsnorm.fused_add_rms_norm", x, residual, w)
    if _jit_tracing():
        return tuple(_fused_fwd(x, residual, w, eps, cast, residual_rounding, residual_dtype)[:2])
    if not _needs_grad(x, residual, w):
        if _direct(x, residual, w):
            return ops.fused_add_rms_norm_checked(x, residual, w, eps, cast, residual_rounding, residual_dtype)
        return _fused_infer(x, residual, w, eps, cast, residual_rounding, residual_dtype)
    if ops.train_lane_fused(x, residual, w, eps, cast, residual_rounding, residual_dtype):
        y, residual_out, _ = _fused_lane(x, residual, w, eps, cast, residual_rounding, None, True)
        return y, residual_out
    x_rows = _rows(_savable(x), "x")  # x first: the residual's checks are stated in terms of x
    check_residual(residual, x, residual_dtype)
    y, residual_out, _ = _apply(
        FusedAddRMSNormFunction, x_rows, _rows(_savable(residual), "residual"), _savable(w), eps, cast, residual_rounding,
        residual_dtype, False,
    )
    return y, residual_out


def fused_add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    *,
    cast: str = "deepseek",
    residual_rounding: str = "fp32_sum",
    residual_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual <- s = x + residual``; ``x <- weight * s * rsqrt(mean(s^2) + eps)``.

    The same values as :func:`fused_add_rms_norm`, written into the inputs (the vLLM / flashinfer
    contract) for callers who need the memory. Inference only: refuses tensors that require grad.

    Args:
        x: ``[..., n]`` float32 / bfloat16 / float16 / float64, overwritten with ``y``.
        residual: ``[..., n]``, overwritten with the new residual in its own dtype: ``x.dtype``, or
            float32 to carry an fp32 stream (then ``residual_dtype`` may be ``torch.float32``).
        weight, eps, cast, residual_rounding: as in :func:`fused_add_rms_norm`.
        residual_dtype: ``None`` or ``torch.float32``; must match the residual buffer's dtype when given.

    Returns:
        ``(x, residual)``, the same tensor objects.
    """
    lane = None if _is_compiling() else ops.lane
    if lane is not None:
        out = lane(_INPLACE, x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)
        if out is not None:
            _increment_version(out)  # what the dispatcher does for a mutating op
            return out
    w = _compute_weight(weight, x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    refuse_forward_ad("dsnorm.fused_add_rms_norm_", x, residual, w)
    refuse_inplace_grad(x, residual, w)  # here too: this route does not pass the dispatcher
    for name, t in (("x", x), ("residual", residual)):
        # The dispatcher has no way to write a mutating op's result through a negated view. (An
        # eager-only probe: dynamo cannot trace it, and compiled graphs functionalise the write.)
        if not _is_compiling() and t.is_neg():
            raise ValueError(f"{name} is a lazily negated view (is_neg(), e.g. z.conj().imag) and cannot "
                             f"be written in place; pass {name}.resolve_neg(), or use fused_add_rms_norm")
    if residual_dtype is not None:
        ops.check_options(eps, cast, residual_rounding, residual_dtype)
        if isinstance(residual, torch.Tensor) and residual.dtype != residual_dtype:
            raise TypeError(
                f"residual must be a {residual_dtype} buffer for residual_dtype={residual_dtype} in place, "
                f"got {residual.dtype}"
            )
    if _direct(x, residual, w):
        ops.fused_add_rms_norm_inplace_checked(x, residual, w, eps, cast, residual_rounding)
        # What the dispatcher would have done for a mutating op: saved-tensor checks see the write.
        _increment_version((x, residual))
    else:
        _fused_inplace(x, residual, w, eps, cast, residual_rounding)
    return x, residual
