"""The plain eager reference: DeepSeek-V3.2-Exp ``inference/model.py`` RMSNorm (lines 280-306).

Everything here is written as plainly as the seed, op for op, so that tests and benchmarks compare
the kernels against exactly what the reference computes. Nothing in this file is fast.

The compatibility modes are defined here too, as eager formulas of their own order:

* ``cast="hf"``: Hugging Face ``DeepseekV3RMSNorm`` in a bf16/fp16 model:
  ``weight.to(dtype) * xhat.to(dtype)`` (x̂ rounded before a low-precision weight multiply).
* ``residual_rounding="round_first"``: vLLM's CUDA kernel / Liger: the residual sum is rounded to
  ``x.dtype`` and that rounded value is normalised.
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
):
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


def rms_norm_backward_ref(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, eps: float = EPS):
    """Gradients of ``y = w * s * r``, ``r = (mean(s^2) + eps)^-1/2``, computed by autograd in fp64.

    Returns ``(ds, dweight)`` in fp64: the reference the kernels' backward is measured against.
    """
    s64 = s.detach().to(torch.float64).requires_grad_(True)
    w64 = weight.detach().to(torch.float64).requires_grad_(True)
    y = w64 * _normalise(s64, eps)
    ds, dw = torch.autograd.grad(y, (s64, w64), dy.to(torch.float64))
    return ds, dw
