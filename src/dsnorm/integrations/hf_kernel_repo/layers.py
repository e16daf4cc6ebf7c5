"""dsnorm's forward for layers that transformers marks ``use_kernel_forward_from_hub("RMSNorm")``
(``DeepseekV3RMSNorm``, ``DeepseekV32RMSNorm``, the Llama family)."""

from __future__ import annotations

import torch

import dsnorm


def _cast(weight: torch.Tensor, x: torch.Tensor) -> str:
    """The cast that reproduces ``weight * xhat.to(x.dtype)`` (transformers' forward).

    A gain in x's dtype is ``cast="hf"``. Any other pair is refused: transformers then returns the
    promoted dtype (an fp32 gain on bf16 activations gives an fp32 output), and on fp64 activations
    it computes in fp32 where dsnorm computes in fp64; neither is a bitwise reproduction."""
    if weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(
            f"dsnorm's kernels RMSNorm serves a weight in the activations' dtype (bf16, fp16 or fp32), "
            f"got weight {weight.dtype} and hidden_states {x.dtype}; un-kernelize this model or cast it")
    return "hf"


class RMSNorm(torch.nn.Module):
    """``weight * (x.float() * rsqrt(mean(x.float()^2) + variance_epsilon)).to(x.dtype)``, bit for
    bit: reads the replaced module's ``weight`` and ``variance_epsilon`` (a kernel layer holds no
    state). Differentiable (dsnorm's backward) and traceable by torch.compile (dsnorm's ops)."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return dsnorm.rms_norm(hidden_states, self.weight, self.variance_epsilon,
                               cast=_cast(self.weight, hidden_states))
