"""Inference fusions around the norm, from where DeepSeek-V3.2-Exp's norms sit in the model.

* :func:`rms_norm_fp8` / :func:`fused_add_rms_norm_fp8`: the norm followed by the fp8 block
  quantisation every Linear of the fp8 model applies to its input (``act_quant``), in one pass.
* :func:`final_norm`: the last norm, on the position the head reads (``h[:, -1]``) only.
* :func:`mla_latent_norms`: ``q_norm`` and ``kv_norm`` of an MLA block in one kernel launch.

All four are **inference-only** paths: forward only (tensors that require grad, with grad mode on,
are refused), DeepSeek's cast order (fp32 weight times fp32 x̂, rounded once to ``x.dtype``), and
the default residual options (the unrounded fp32 sum is normalised; the residual stream is in
``x.dtype``). ``cast``, ``residual_rounding`` and ``residual_dtype`` are accepted only at their
defaults, so that other values are refused by name; use :func:`dsnorm.rms_norm` /
:func:`dsnorm.fused_add_rms_norm` for those.

Each has a ``torch.ops.dsnorm`` op (CPU: numba, :mod:`dsnorm.cpu.launch`; CUDA: Triton,
:mod:`dsnorm.triton.fusions`) with checks shared by the real and fake impls. The eager reference
of the quantisation, :func:`act_quant_ref`, is written from the semantics of DeepSeek's
``act_quant`` (not from its code):

* per row, blocks of ``block_size`` (128) columns; ``amax = max(max|y_block|, 1e-4)`` in fp32;
* ``s = amax * (1/448)``: an fp32 multiply by ``fp32(1/448)`` (= 0x3B124925), literally torch's
  ``amax * (1.0 / 448)``; this is *not* always ``amax / 448`` (they differ by one ulp for some
  amax); with ``scale_fmt="ue8m0"``, ``s = 2^ceil(log2(s))``, the smallest power of two >= s,
  computed exactly (``frexp`` in the reference, bit arithmetic in the kernels: ``log2`` in fp32
  rounds values just above a power of two down onto it);
* ``q = clamp(y / s, -448, 448).to(float8_e4m3fn)``: IEEE fp32 division, round to nearest even.
  NaN: a block holding a NaN gets a NaN scale and NaN q (0x7F, or 0xFF for a negative NaN, as
  torch converts); values of equal NaN-ness compare equal in the tests, payloads are not specified.
"""

from __future__ import annotations

from typing import Literal, Optional, overload

import torch

from dsnorm import ops
from dsnorm.autograd import _compute_weight, _direct, _needs_grad
from dsnorm.dispatch import _is_compiling
from dsnorm.ref import (  # noqa: F401 (re-exported: the fusions' reference lives in ref.py)
    AMAX_FLOOR,
    EPS,
    FP8_INPUT_DTYPES,
    FP8_MAX,
    MAX_BLOCK,
    MIN_BLOCK,
    SCALE_FMTS,
    _check_quant_args,
    act_quant_ref,
    fused_add_rms_norm_fp8_ref,
    fused_add_rms_norm_ref,
    rms_norm_fp8_ref,
    rms_norm_ref,
)

__all__ = [
    "FP8_MAX",
    "SCALE_FMTS",
    "act_quant_ref",
    "final_norm",
    "fused_add_rms_norm_fp8",
    "mla_latent_norms",
    "rms_norm_fp8",
]

# ---------------------------------------------------------------------------------------------
# Ops.

lib = ops.lib
lib.define(
    "rms_norm_fp8(Tensor x, Tensor weight, float eps, str? scale_fmt, int block_size, bool return_normed) "
    "-> (Tensor, Tensor, Tensor)"
)
lib.define(
    "fused_add_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, float eps, str? scale_fmt, int block_size, "
    "bool return_normed) -> (Tensor, Tensor, Tensor, Tensor)"
)
lib.define("final_norm(Tensor h, Tensor residual, Tensor weight, float eps, Tensor? lengths) -> (Tensor, Tensor)")
lib.define(
    "mla_latent_norms(Tensor q_latent, Tensor kv_a, Tensor q_weight, Tensor kv_weight, float eps) -> (Tensor, Tensor)"
)

_fusion_launchers: dict = {}


def _launcher(t: torch.Tensor):
    """dsnorm.cpu.launch or dsnorm.triton.fusions: both also have their device's core
    ``forward`` and ``empty_output``."""
    kind = "cpu" if t.is_cpu else t.device.type
    mod = _fusion_launchers.get(kind)
    if mod is None:
        ops._launcher(t)  # the core's device check and its error for a missing Triton
        if kind == "cpu":
            from dsnorm.cpu import launch as mod
        else:
            from dsnorm.triton import fusions as mod
        _fusion_launchers[kind] = mod
    return mod


def _check_fp8(x, weight, eps, scale_fmt, block_size, return_normed):
    ops.check_input(x)
    if x.dtype not in FP8_INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32 for the fp8 paths, got {x.dtype}")
    ops.check_weight(weight, x)
    ops.check_options(eps, "deepseek")
    _check_quant_args(x, block_size, scale_fmt)
    if not isinstance(return_normed, bool):
        raise TypeError(f"return_normed must be a bool, got {type(return_normed).__name__}")


def _fp8_outputs(x, block_size, return_normed, empty):
    q = empty(x, torch.float8_e4m3fn)
    scales = x.new_empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.float32)
    y = empty(x, x.dtype) if return_normed else x.new_empty((0,))
    return q, scales, y


def _rms_norm_fp8_impl(x, weight, eps, scale_fmt, block_size, return_normed):
    _check_fp8(x, weight, eps, scale_fmt, block_size, return_normed)
    x = ops.readable_rows(x)
    launcher = _launcher(x)
    q, scales, y = _fp8_outputs(x, block_size, return_normed, launcher.empty_output)
    launcher.rms_norm_fp8(x, None, weight, eps, scale_fmt == "ue8m0", block_size, y if return_normed else None,
                          None, q, scales)
    return q, scales, y


def _fused_fp8_impl(x, residual, weight, eps, scale_fmt, block_size, return_normed):
    _check_fp8(x, weight, eps, scale_fmt, block_size, return_normed)
    ops.check_residual(residual, x, None, fp32_hint=False, mixed=False, why="the fusions take x's dtype")
    x = ops.readable_rows(x)
    residual = ops.readable_rows(residual)
    launcher = _launcher(x)
    q, scales, y = _fp8_outputs(x, block_size, return_normed, launcher.empty_output)
    residual_out = launcher.empty_output(x, x.dtype)
    launcher.rms_norm_fp8(x, residual, weight, eps, scale_fmt == "ue8m0", block_size,
                          y if return_normed else None, residual_out, q, scales)
    return q, scales, residual_out, y


def _check_final_residual(residual, h):
    """final_norm's residual, of either form (last_only or not): h's shape, device and dtype."""
    ops.check_residual(residual, h, None, fp32_hint=False, mixed=False, x_name="h", why="the fusions take h's dtype")


def _check_final(h, residual, weight, eps, lengths):
    ops.check_input(h, "h")
    if h.dim() != 3:
        raise ValueError(f"h must be [batch, seq, dim] (3-D), got shape {tuple(h.shape)}")
    if h.shape[1] == 0:
        raise ValueError(f"h must have at least one position (seq >= 1), got shape {tuple(h.shape)}")
    _check_final_residual(residual, h)
    ops.check_weight(weight, h, "h")
    ops.check_options(eps, "deepseek")
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor):
            raise TypeError(f"lengths must be a torch.Tensor or None, got {type(lengths).__name__}")
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
        ops.check_same_sizes(lengths.shape, (h.shape[0],), lambda: f"lengths must have shape ({h.shape[0]},) (one "
                             f"per batch row of h), got {tuple(lengths.shape)}")
        if lengths.device != h.device:
            raise ValueError(f"lengths must be on h's device {h.device}, got {lengths.device}")


def _check_lengths_values(lengths: torch.Tensor, seq: int) -> None:
    if lengths.numel() == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())  # a device sync on CUDA: the price of the check
    if lo < 1 or hi > seq:
        raise ValueError(f"lengths must be in [1, {seq}] (h's seq dimension), got values in [{lo}, {hi}]")


def _final_impl(h, residual, weight, eps, lengths):
    _check_final(h, residual, weight, eps, lengths)
    launcher = _launcher(h)
    batch, seq, n = h.shape
    y = h.new_empty((batch, n))
    residual_out = h.new_empty((batch, n))
    if lengths is None:
        # h[:, -1] is a strided [B, n] view: the core kernel reads those rows in place.
        launcher.forward(ops.readable_rows(h[:, -1]), ops.readable_rows(residual[:, -1]), weight, eps, False, False,
                         y, residual_out, None)
    else:
        # The kernel reads positions unchecked: it must read the values checked, so check (and
        # launch from) a private copy. The caller's tensor may be rewritten meanwhile, by another
        # thread or stream (a scheduler reusing its buffer), and .to(int64) of an int64 tensor is
        # that tensor itself.
        if lengths.is_cuda and torch.cuda.is_current_stream_capturing():
            # Checking the values needs them on the host, a synchronisation that a capture forbids
            # (CUDA's own error names no argument); an unchecked position would read out of bounds.
            raise RuntimeError(
                "lengths: final_norm checks the lengths' values on the host, which a CUDA graph capture "
                "does not allow; capture final_norm with lengths=None (each row's last position) or call it "
                "outside the graph")
        lengths = lengths.to(torch.int64, copy=True).contiguous()
        _check_lengths_values(lengths, seq)
        h = h if h.stride(-1) == 1 else h.contiguous()
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
        launcher.final_norm_lengths(h, residual, weight, eps, lengths, y, residual_out)
    return y, residual_out


def _check_latent_weight(weight, name, like, width=None):
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or weight.shape[0] == 0:
        raise ValueError(f"{name} must be 1-D and non-empty, got shape {tuple(weight.shape)}")
    if width is not None and weight.shape[0] != width:
        raise ValueError(f"{name} must have shape ({width},) to match q_latent's last dimension, got "
                         f"{tuple(weight.shape)}")
    if weight.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {weight.device}")
    if not weight.is_contiguous():
        raise ValueError(f"{name} must be contiguous (unit stride) at the op level, got stride {weight.stride()}")
    if weight.dtype != ops.compute_dtype(like.dtype):
        raise TypeError(f"{name} must be {ops.compute_dtype(like.dtype)} at the op level, got {weight.dtype}; "
                        "dsnorm.fusions.mla_latent_norms upcasts other weights exactly")


def _check_mla(q_latent, kv_a, q_weight, kv_weight, eps):
    ops.check_input(q_latent, "q_latent")
    ops.check_input(kv_a, "kv_a")
    if kv_a.dtype != q_latent.dtype:
        raise TypeError(f"kv_a must have q_latent's dtype {q_latent.dtype}, got {kv_a.dtype}")
    if kv_a.device != q_latent.device:
        raise ValueError(f"kv_a must be on q_latent's device {q_latent.device}, got {kv_a.device}")
    ops.check_same_sizes(kv_a.shape[:-1], q_latent.shape[:-1], lambda: f"kv_a must have q_latent's leading shape "
                         f"{tuple(q_latent.shape[:-1])}, got {tuple(kv_a.shape)}")
    _check_latent_weight(q_weight, "q_weight", q_latent, q_latent.shape[-1])
    _check_latent_weight(kv_weight, "kv_weight", kv_a)
    if kv_weight.shape[0] > kv_a.shape[-1]:
        raise ValueError(f"kv_weight's width {kv_weight.shape[0]} (kv_lora_rank) must be <= kv_a's last dimension "
                         f"{kv_a.shape[-1]}")
    ops.check_options(eps, "deepseek")


def _mla_impl(q_latent, kv_a, q_weight, kv_weight, eps):
    _check_mla(q_latent, kv_a, q_weight, kv_weight, eps)
    q_latent = ops.readable_rows(q_latent)
    kv_a = ops.readable_rows(kv_a)  # the kernels read the first kv_lora_rank columns in place
    launcher = _launcher(q_latent)
    q_out = launcher.empty_output(q_latent, q_latent.dtype)
    kv_out = torch.empty((*kv_a.shape[:-1], kv_weight.shape[0]), dtype=kv_a.dtype, device=kv_a.device)
    launcher.mla_latent_norms(q_latent, kv_a, q_weight, kv_weight, eps, q_out, kv_out)
    return q_out, kv_out


for _key in ("CPU", "CUDA"):
    lib.impl("rms_norm_fp8", _rms_norm_fp8_impl, _key)
    lib.impl("fused_add_rms_norm_fp8", _fused_fp8_impl, _key)
    lib.impl("final_norm", _final_impl, _key)
    lib.impl("mla_latent_norms", _mla_impl, _key)


def _fake_empty(like, dtype):
    return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("dsnorm::rms_norm_fp8", lib=lib)
def _rms_norm_fp8_fake(x, weight, eps, scale_fmt, block_size, return_normed):
    _check_fp8(x, weight, eps, scale_fmt, block_size, return_normed)
    return _fp8_outputs(x, block_size, return_normed, _fake_empty)


@torch.library.register_fake("dsnorm::fused_add_rms_norm_fp8", lib=lib)
def _fused_fp8_fake(x, residual, weight, eps, scale_fmt, block_size, return_normed):
    _check_fp8(x, weight, eps, scale_fmt, block_size, return_normed)
    ops.check_residual(residual, x, None, fp32_hint=False, mixed=False, why="the fusions take x's dtype")
    q, scales, y = _fp8_outputs(x, block_size, return_normed, _fake_empty)
    return q, scales, _fake_empty(x, x.dtype), y


@torch.library.register_fake("dsnorm::final_norm", lib=lib)
def _final_fake(h, residual, weight, eps, lengths):
    _check_final(h, residual, weight, eps, lengths)  # lengths' values need data: checked when run
    return h.new_empty((h.shape[0], h.shape[2])), h.new_empty((h.shape[0], h.shape[2]))


@torch.library.register_fake("dsnorm::mla_latent_norms", lib=lib)
def _mla_fake(q_latent, kv_a, q_weight, kv_weight, eps):
    _check_mla(q_latent, kv_a, q_weight, kv_weight, eps)
    kv_shape = (*kv_a.shape[:-1], kv_weight.shape[0])
    return _fake_empty(q_latent, q_latent.dtype), q_latent.new_empty(kv_shape)


_fp8_op = torch.ops.dsnorm.rms_norm_fp8
_fused_fp8_op = torch.ops.dsnorm.fused_add_rms_norm_fp8
_final_op = torch.ops.dsnorm.final_norm
_mla_op = torch.ops.dsnorm.mla_latent_norms


# ---------------------------------------------------------------------------------------------
# Functional API.


def _refuse_options(what: str, cast="deepseek", residual_rounding="fp32_sum", residual_dtype=None) -> None:
    """The fusions take the compatibility options only to refuse other values by name."""
    for name, value, default in (("cast", cast, "deepseek"), ("residual_rounding", residual_rounding, "fp32_sum"),
                                 ("residual_dtype", residual_dtype, None)):
        if value != default:
            raise ValueError(
                f"{what} is an inference path with DeepSeek's numerics only ({name}={default!r}); got "
                f"{name}={value!r}: use dsnorm.rms_norm / dsnorm.fused_add_rms_norm for the compatibility options"
            )


def _refuse_grad(what: str, *tensors) -> None:
    ops.refuse_forward_ad(what, *tensors)
    if _needs_grad(*tensors):
        raise RuntimeError(
            f"{what} is an inference-only path (forward only, no gradient): call it under torch.no_grad() / "
            "torch.inference_mode(), or use dsnorm.rms_norm / dsnorm.fused_add_rms_norm for training"
        )


@overload
def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, scale_fmt: Optional[str] = ...,
    block_size: int = ..., return_normed: Literal[False] = ..., cast: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, scale_fmt: Optional[str] = ...,
    block_size: int = ..., return_normed: Literal[True], cast: str = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, scale_fmt: Optional[str] = ...,
    block_size: int = ..., return_normed: bool = ..., cast: str = ...,
) -> tuple[torch.Tensor, ...]: ...


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    *,
    scale_fmt: Optional[str] = None,
    block_size: int = 128,
    return_normed: bool = False,
    cast: str = "deepseek",
) -> tuple[torch.Tensor, ...]:
    """``q, s = act_quant(y)`` with ``y = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)``.

    The norm and DeepSeek's per-row fp8 block quantisation of the next Linear's input in one pass:
    bitwise ``act_quant_ref(rms_norm(x, weight, eps), block_size, scale_fmt)`` on the CPU (on CUDA
    ``y`` is within the GPU tolerance of README's "Fidelity", and ``q``, ``scales`` are those of
    that ``y``). The quantisation
    reads ``y`` rounded to ``x.dtype`` (what the two-step model computes). Inference only: forward,
    DeepSeek cast order (``cast`` other than ``"deepseek"`` is refused by name); tensors requiring
    grad (grad mode on) are refused.

    Args:
        x: ``[..., n]`` bfloat16 / float16 / float32, ``n`` a multiple of ``block_size``; rows may
            be strided (unit stride along n).
        weight: ``[n]`` gain (float32 canonical; bf16/fp16 widened exactly).
        eps: > 0, with a nonzero finite float32 rounding (about 1.4e-45 to 3.4e38).
        scale_fmt: ``None`` (fp32 scales, ``act_quant``'s default) or ``"ue8m0"`` (power-of-two
            scales). The V3.2-Exp 671B config sets ``"scale_fmt": "ue8m0"`` and its Linears use it:
            pass ``"ue8m0"`` to reproduce that model.
        block_size: columns per scale, a power of two in [16, 4096] (128 in DeepSeek).
        return_normed: also return ``y``.

    Returns:
        ``(q, scales)``: ``q`` ``[..., n]`` float8_e4m3fn, ``scales`` ``[..., n // block_size]``
        float32 (``q * scale`` approximates ``y``); ``+ (y,)`` (``x.dtype``) with ``return_normed``.
    """
    w = _compute_weight(weight, x)
    _refuse_options("rms_norm_fp8", cast)
    _refuse_grad("rms_norm_fp8", x, w)
    if _direct(x, w):
        out = _rms_norm_fp8_impl(x, w, eps, scale_fmt, block_size, return_normed)
    else:
        out = _fp8_op(x, w, eps, scale_fmt, block_size, return_normed)
    return tuple(out) if return_normed else tuple(out[:2])


@overload
def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = ..., *,
    scale_fmt: Optional[str] = ..., block_size: int = ..., return_normed: Literal[False] = ..., cast: str = ...,
    residual_rounding: str = ..., residual_dtype: Optional[torch.dtype] = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = ..., *,
    scale_fmt: Optional[str] = ..., block_size: int = ..., return_normed: Literal[True], cast: str = ...,
    residual_rounding: str = ..., residual_dtype: Optional[torch.dtype] = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...
@overload
def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = ..., *,
    scale_fmt: Optional[str] = ..., block_size: int = ..., return_normed: bool = ..., cast: str = ...,
    residual_rounding: str = ..., residual_dtype: Optional[torch.dtype] = ...,
) -> tuple[torch.Tensor, ...]: ...


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    *,
    scale_fmt: Optional[str] = None,
    block_size: int = 128,
    return_normed: bool = False,
    cast: str = "deepseek",
    residual_rounding: str = "fp32_sum",
    residual_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, ...]:
    """``s = x.float() + residual.float()``; ``y = (weight * (s * rsqrt(mean(s^2) + eps))).to(x.dtype)``;
    ``q, scales = act_quant(y)``.

    Bitwise ``act_quant_ref(y)`` with ``y, residual_out = fused_add_rms_norm(x, residual, weight,
    eps)`` on the CPU (on CUDA as :func:`rms_norm_fp8` says). Inference only: forward, DeepSeek
    cast order and the default residual options (the unrounded fp32 sum is normalised, the
    residual is in ``x.dtype``): other ``cast`` /
    ``residual_rounding`` / ``residual_dtype`` values are refused by name; tensors requiring grad
    are refused.

    Args:
        x: ``[..., n]`` bfloat16 / float16 / float32, ``n`` a multiple of ``block_size``.
        residual: ``[..., n]`` residual stream in ``x.dtype``.
        weight, eps, scale_fmt, block_size, return_normed: as in :func:`rms_norm_fp8`.

    Returns:
        ``(q, scales, residual_out)``: ``q`` ``[..., n]`` float8_e4m3fn, ``scales``
        ``[..., n // block_size]`` float32, ``residual_out = s`` in ``x.dtype``; ``+ (y,)`` with
        ``return_normed``.
    """
    w = _compute_weight(weight, x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    _refuse_options("fused_add_rms_norm_fp8", cast, residual_rounding, residual_dtype)
    _refuse_grad("fused_add_rms_norm_fp8", x, residual, w)
    if _direct(x, residual, w):
        out = _fused_fp8_impl(x, residual, w, eps, scale_fmt, block_size, return_normed)
    else:
        out = _fused_fp8_op(x, residual, w, eps, scale_fmt, block_size, return_normed)
    return tuple(out) if return_normed else tuple(out[:3])


def final_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    *,
    last_only: bool = True,
    lengths: Optional[torch.Tensor] = None,
    cast: str = "deepseek",
    residual_rounding: str = "fp32_sum",
    residual_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = h.float() + residual.float()``; ``y = (weight * (s * rsqrt(mean(s^2) + eps))).to(h.dtype)``
    at the last (valid) position of each sequence only.

    The model's final norm feeds ``head(h[:, -1])``: normalising only that position is bitwise
    ``fused_add_rms_norm(h, residual, weight, eps)[i][:, -1]`` for ``i = 0, 1`` at ~1/T of the work
    on the CPU (on CUDA: the residual bitwise, ``y`` within the GPU tolerance of README's "Fidelity").
    Inference only: forward, DeepSeek cast order, default residual options; tensors requiring grad
    are refused.

    Args:
        h: ``[B, T, d]`` bfloat16 / float16 / float32 / float64 (the last block's output).
        residual: ``[B, T, d]`` residual stream in ``h.dtype``.
        weight: ``[d]`` gain (float32 canonical).
        eps: > 0, with a nonzero finite float32 rounding (about 1.4e-45 to 3.4e38).
        last_only: ``True`` (default): position ``T - 1`` (or ``lengths - 1``) only; ``False``: the
            full norm over all T positions.
        lengths: optional integer ``[B]`` tensor on h's device, values in ``[1, T]``: row b's last
            valid position is ``lengths[b] - 1`` (right-padded batches). Only with ``last_only``.
            Its values are checked on the host (on CUDA a synchronisation), so a call with
            ``lengths`` cannot be captured in a CUDA graph (``RuntimeError``); ``lengths=None`` can.

    Returns:
        ``(y, residual_out)``, each ``[B, d]`` in ``h.dtype`` (``[B, T, d]`` with ``last_only=False``).
    """
    if not isinstance(last_only, bool):
        raise TypeError(f"last_only must be a bool, got {type(last_only).__name__}")
    w = _compute_weight(weight, h, x_name="h")
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if lengths is not None and not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths must be a torch.Tensor or None, got {type(lengths).__name__}")
    _refuse_options("final_norm", cast, residual_rounding, residual_dtype)
    _refuse_grad("final_norm", h, residual, w)
    if not last_only:
        if lengths is not None:
            raise ValueError("lengths selects each row's last valid position and needs last_only=True; with "
                             "last_only=False every position is normalised")
        from dsnorm.autograd import fused_add_rms_norm

        _check_final_residual(residual, h)  # the core form would widen an fp32 residual
        return fused_add_rms_norm(h, residual, w, eps)
    if _direct(h, residual, w) and (lengths is None or _direct(lengths)):
        return _final_impl(h, residual, w, eps, lengths)
    return tuple(_final_op(h, residual, w, eps, lengths))


_mla_lane = None


def _load_mla_lane():
    # Imported on first use: importing dsnorm loads no numba.
    global _mla_lane
    from dsnorm.cpu.lane import mla_lane

    _mla_lane = mla_lane
    return mla_lane


def mla_latent_norms(
    q_latent: torch.Tensor,
    kv_a: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    eps: float = EPS,
    *,
    cast: str = "deepseek",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_norm(q_latent)`` and ``kv_norm(kv_a[..., :r])``, ``r = kv_weight.shape[0]``, each
    ``y = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)``, in one kernel launch.

    Bitwise ``(rms_norm(q_latent, q_weight, eps), rms_norm(kv_a[..., :r], kv_weight, eps))`` on the
    CPU; on CUDA each within the GPU tolerance of README's "Fidelity" (one launch for both rows
    may reduce in another order than two). The
    kv slice is read in place (strided rows, no copy); ``kv_a`` is not written, so its rotary
    columns ``[r:]`` are untouched. Inference only: forward, DeepSeek cast order; tensors requiring
    grad are refused.

    Args:
        q_latent: ``[..., q_lora_rank]`` (1536 in the 671B model), ``wq_a(x)``; bfloat16 / float16
            / float32 / float64.
        kv_a: ``[..., kv_lora_rank + rope_dim]`` (512 + 64), ``wkv_a(x)``; same dtype and leading
            shape as ``q_latent``.
        q_weight: ``[q_lora_rank]`` gain; kv_weight: ``[kv_lora_rank]`` gain (float32 canonical).
        eps: > 0, with a nonzero finite float32 rounding (about 1.4e-45 to 3.4e38).

    Returns:
        ``(q_normed, kv_normed)``: new contiguous tensors ``[..., q_lora_rank]`` and
        ``[..., kv_lora_rank]`` in the inputs' dtype.
    """
    # Not under dynamo (see autograd._is_compiling); CPU tensors only: the lane's module loads numba.
    if not _is_compiling() and isinstance(q_latent, torch.Tensor) and q_latent.is_cpu:
        out = (_mla_lane or _load_mla_lane())(q_latent, kv_a, q_weight, kv_weight, eps, cast)
        if out is not None:  # a decode call on the CPU that needs only the kernel
            return out
    wq = _compute_weight(q_weight, q_latent, "q_weight", "q_latent")
    wkv = _compute_weight(kv_weight, q_latent, "kv_weight", "q_latent")
    if not isinstance(kv_a, torch.Tensor):
        raise TypeError(f"kv_a must be a torch.Tensor, got {type(kv_a).__name__}")
    _refuse_options("mla_latent_norms", cast)
    _refuse_grad("mla_latent_norms", q_latent, kv_a, wq, wkv)
    if _direct(q_latent, kv_a, wq, wkv):
        return _mla_impl(q_latent, kv_a, wq, wkv, eps)
    return tuple(_mla_op(q_latent, kv_a, wq, wkv, eps))


# ---------------------------------------------------------------------------------------------
# Bench cases (for ``dsnorm bench`` and benchmarks/fusions.py).


def _quantised_fused(x, residual, weight):
    # The eager composition of fused_add_rms_norm_fp8: (q, scales, residual_out), its output order.
    from dsnorm.autograd import fused_add_rms_norm

    y, residual_out = fused_add_rms_norm(x, residual, weight)
    return (*act_quant_ref(y, 128, "ue8m0"), residual_out)


def bench_cases(quick: bool = False, device: str = "cpu"):
    """The three fusions against their eager compositions, as callables with byte models.

    Returns a list of dicts: ``name``, ``shape`` (list of ints; for the MLA pair the two inputs'
    widths added, see ``layout``), ``form`` (plain / fused), ``fused`` and ``baseline`` (zero-argument
    callables: the fusion, and the same outputs composed of dsnorm's unfused calls), ``reference``
    (the same outputs from :mod:`dsnorm.ref`'s eager formulas, to verify both against), ``bytes``
    (DRAM bytes the fused call must move: inputs read once, outputs written once), ``baseline_name``, ``normed`` (indices of the outputs that are normalised values, held to
    <= 1 ulp on a GPU; fp8 codes and scales are not). Tensors are built once here.
    """
    from dsnorm.autograd import fused_add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(bf16).to(device)

    cases = []
    d = 7168
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    for rows in ([1, 4096] if quick else [1, 64, 4096]):
        x, r = randn(1, rows, d), randn(1, rows, d, scale=4.0)
        e = x.element_size()
        cases.append(dict(
            name=f"fused_add_rms_norm_fp8 ue8m0 T={rows}", shape=[1, rows, d], form="fused",
            fused=lambda x=x, r=r: fused_add_rms_norm_fp8(x, r, w, scale_fmt="ue8m0"),
            baseline=lambda x=x, r=r: _quantised_fused(x, r, w),
            reference=lambda x=x, r=r: fused_add_rms_norm_fp8_ref(x, r, w, scale_fmt="ue8m0")[:3],
            baseline_name="act_quant_ref(fused_add_rms_norm)", normed=(),
            bytes=rows * d * (2 * e + e + 1) + rows * (d // 128) * 4 + 4 * d,
        ))
        cases.append(dict(
            name=f"rms_norm_fp8 ue8m0 T={rows}", shape=[1, rows, d], form="plain",
            fused=lambda x=x: rms_norm_fp8(x, w, scale_fmt="ue8m0"),
            baseline=lambda x=x: act_quant_ref(rms_norm(x, w), 128, "ue8m0"),
            reference=lambda x=x: rms_norm_fp8_ref(x, w, scale_fmt="ue8m0")[:2],
            baseline_name="act_quant_ref(rms_norm)", normed=(),
            bytes=rows * d * (e + 1) + rows * (d // 128) * 4 + 4 * d,
        ))
    for batch, seq in ([(1, 4096)] if quick else [(1, 4096), (4, 1024)]):
        h, r = randn(batch, seq, d), randn(batch, seq, d, scale=4.0)
        cases.append(dict(
            name=f"final_norm last_only B={batch} T={seq}", shape=[batch, seq, d], form="fused",
            fused=lambda h=h, r=r: final_norm(h, r, w),
            baseline=lambda h=h, r=r: tuple(t[:, -1] for t in fused_add_rms_norm(h, r, w)),
            reference=lambda h=h, r=r: tuple(t[:, -1] for t in fused_add_rms_norm_ref(h, r, w)),
            baseline_name="fused_add_rms_norm(h)[:, -1]", normed=(0,),
            bytes=batch * d * 2 * 4 + 4 * d,
        ))
    wq = (1 + 0.1 * torch.randn(1536, generator=gen)).to(device)
    wkv = (1 + 0.1 * torch.randn(512, generator=gen)).to(device)
    for batch in ([1, 64] if quick else [1, 2, 4, 8, 16, 32, 64]):
        q, kv = randn(batch, 1536), randn(batch, 576)
        cases.append(dict(
            name=f"mla_latent_norms B={batch}", shape=[batch, 1536 + 576], form="plain", layout="q [B,1536] + kv [B,512 of 576]",
            fused=lambda q=q, kv=kv: mla_latent_norms(q, kv, wq, wkv),
            baseline=lambda q=q, kv=kv: (rms_norm(q, wq), rms_norm(kv[..., :512], wkv)),
            reference=lambda q=q, kv=kv: (rms_norm_ref(q, wq), rms_norm_ref(kv[..., :512], wkv)),
            baseline_name="rms_norm x2", normed=(0, 1),
            bytes=batch * (1536 + 512) * 2 * 2 + 4 * (1536 + 512),
        ))
    return cases
