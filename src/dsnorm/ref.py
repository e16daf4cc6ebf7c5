"""The plain eager reference: DeepSeek-V3.2-Exp ``inference/model.py`` RMSNorm (lines 280-306 at the
revision the seeds pin, 87e509a2e5a1; lines 273-307 in the GitHub repository's commit 2305c7e).

Everything here is written as plainly as the seed, op for op, so that tests and benchmarks compare
the kernels against exactly what the reference computes. Nothing in this file is fast.

The compatibility modes are defined here too, as eager formulas of their own order:

* ``cast="hf"``: Hugging Face ``DeepseekV3RMSNorm`` in a bf16/fp16 model:
  ``weight.to(dtype) * xhat.to(dtype)`` (x̂ rounded before a low-precision weight multiply).
* ``residual_rounding="round_first"``: the order of vLLM's CUDA kernel and Liger's fused add (not
  their bits: README's compatibility footnote): the residual sum is rounded to ``x.dtype`` and that
  rounded value is normalised.
* ``residual_dtype=torch.float32``: the residual stream is kept (accepted and returned) in fp32.

One documented departure from the seed: fp64 inputs are computed in fp64 (the seed's ``x.float()``
would drop them to fp32), so that ``gradcheck`` can run on dsnorm's own kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

EPS = 1e-6
CASTS = ("deepseek", "hf")
RESIDUAL_ROUNDINGS = ("fp32_sum", "round_first")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the norm is computed in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNormRef(nn.Module):
    """The seed's class, unchanged: ``y = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        dtype = x.dtype
        if residual is None:
            x = x.float()
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            return (self.weight * x).to(dtype)
        else:
            x = residual = x.float() + residual.float()
            var = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(var + self.eps)
            return (self.weight * x).to(dtype), residual.to(dtype)


def _normalise(s: torch.Tensor, eps: float) -> torch.Tensor:
    # x̂ = s * rsqrt(mean(s^2) + eps), in s's own (compute) dtype, op for op as in the seed.
    var = s.pow(2).mean(-1, keepdim=True)
    return s * torch.rsqrt(var + eps)


def _scale(xhat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, cast: str) -> torch.Tensor:
    if cast == "deepseek":
        return (weight.to(xhat.dtype) * xhat).to(dtype)
    if cast == "hf":
        return weight.to(dtype) * xhat.to(dtype)
    raise ValueError(f"cast must be one of {CASTS}, got {cast!r}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS, cast: str = "deepseek") -> torch.Tensor:
    """Eager reference of ``rms_norm``: ``y = weight * x / sqrt(mean(x^2) + eps)``, cast once to x.dtype."""
    xhat = _normalise(x.to(compute_dtype(x.dtype)), eps)
    return _scale(xhat, weight, x.dtype, cast)


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = EPS,
    cast: str = "deepseek",
    residual_rounding: str = "fp32_sum",
    residual_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference of ``fused_add_rms_norm``: returns ``(y, residual_out)``.

    ``s = x + residual`` in the compute dtype; ``"fp32_sum"`` normalises the unrounded ``s``,
    ``"round_first"`` normalises ``s.to(x.dtype)``. ``residual_out`` is ``s`` in ``residual_dtype``
    (default ``x.dtype``).
    """
    cdtype = compute_dtype(x.dtype)
    s = x.to(cdtype) + residual.to(cdtype)
    if residual_rounding == "round_first":
        s = s.to(x.dtype).to(cdtype)
    elif residual_rounding != "fp32_sum":
        raise ValueError(f"residual_rounding must be one of {RESIDUAL_ROUNDINGS}, got {residual_rounding!r}")
    out_dtype = x.dtype if residual_dtype is None else residual_dtype
    return _scale(_normalise(s, eps), weight, x.dtype, cast), s.to(out_dtype)


def rms_norm_backward_ref(
    dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``y = w * s * r``, ``r = (mean(s^2) + eps)^-1/2``, computed by autograd in fp64.

    Returns ``(ds, dweight)`` in fp64: the reference the kernels' backward is measured against.
    """
    s64 = s.detach().to(torch.float64).requires_grad_(True)
    w64 = weight.detach().to(torch.float64).requires_grad_(True)
    y = w64 * _normalise(s64, eps)
    ds, dw = torch.autograd.grad(y, (s64, w64), dy.to(torch.float64))
    return ds, dw


# ---------------------------------------------------------------------------------------------
# fp8 block quantisation (DeepSeek's act_quant, from its semantics) for the inference fusions.

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
SCALE_FMTS = (None, "ue8m0")
FP8_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_BLOCK, MAX_BLOCK = 16, 4096


def _check_quant_args(x: torch.Tensor, block_size, scale_fmt, name: str = "x") -> None:
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be None (act_quant's default) or 'ue8m0', got {scale_fmt!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if not (MIN_BLOCK <= block_size <= MAX_BLOCK) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}] (DeepSeek uses 128), got {block_size}"
        )
    if x.dim() == 0 or x.shape[-1] % block_size != 0 or x.shape[-1] == 0:
        width = "a scalar" if x.dim() == 0 else f"width {x.shape[-1]}"
        raise ValueError(
            f"{name}'s last dimension must be a positive multiple of block_size={block_size} for fp8 block "
            f"quantisation, got {width}"
        )


def act_quant_ref(
    x: torch.Tensor, block_size: int = 128, scale_fmt: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager ``act_quant``: ``s = max(max|x_blk|, 1e-4) * (1/448)`` (ue8m0: ``2^ceil(log2 s)``),
    ``q = clamp(x / s, -448, 448).to(float8_e4m3fn)``, per row in blocks of ``block_size``.

    Args:
        x: ``[..., n]`` float tensor, ``n`` a multiple of ``block_size``; computed as ``x.float()``.
        block_size: columns per scale (128 in DeepSeek).
        scale_fmt: ``None`` (fp32 scales, act_quant's default) or ``"ue8m0"`` (power-of-two scales,
            the 671B config).

    Returns:
        ``(q, s)``: ``q`` ``[..., n]`` float8_e4m3fn, ``s`` ``[..., n // block_size]`` float32.
    """
    _check_quant_args(x, block_size, scale_fmt)
    xb = x.float().unflatten(-1, (-1, block_size))
    amax = xb.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    s = amax * (1.0 / FP8_MAX)  # an fp32 tensor times a Python float: fp32 multiply by fp32(1/448)
    if scale_fmt == "ue8m0":
        mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1): a power of two iff mant == 0.5
        exp = torch.where(mant == 0.5, exp - 1, exp)
        s = torch.where(torch.isfinite(s), torch.ldexp(torch.ones_like(s), exp), s)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def rms_norm_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = EPS, *, scale_fmt: Optional[str] = None,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``act_quant_ref(rms_norm_ref(x, weight, eps))`` in two eager steps: ``(q, s, y)``."""
    y = rms_norm_ref(x, weight.float(), eps)
    return (*act_quant_ref(y, block_size, scale_fmt), y)


def fused_add_rms_norm_fp8_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS, *,
    scale_fmt: Optional[str] = None, block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y, r = fused_add_rms_norm_ref(...)``; ``act_quant_ref(y)``: ``(q, s, r, y)``."""
    y, r = fused_add_rms_norm_ref(x, residual, weight.float(), eps)
    return (*act_quant_ref(y, block_size, scale_fmt), r, y)
