"""dsnorm: DeepSeek-V3.2-Exp's RMSNorm, exact to the reference, with fused CPU and GPU kernels.

``y = weight * x / sqrt(mean(x^2) + eps)`` computed in float32, cast once to ``x.dtype``; the fused
form normalises the unrounded fp32 sum ``x + residual`` and also returns it rounded to ``x.dtype``.
Importing the package probes no device and compiles nothing.
"""

import torch

from dsnorm.autograd import fused_add_rms_norm, fused_add_rms_norm_, rms_norm
from dsnorm.checkpoint import load_norms
from dsnorm.memory import empty_cache
from dsnorm.fusions import final_norm, fused_add_rms_norm_fp8, mla_latent_norms, rms_norm_fp8
from dsnorm.module import RMSNorm
from dsnorm.patching import patch
from dsnorm.ref import RMSNormRef, fused_add_rms_norm_ref, rms_norm_ref

if torch.distributed.is_available():
    # DTensor sharding rules: registered once torch.distributed.tensor is imported (not imported here).
    from dsnorm import distributed  # noqa: F401

__all__ = [
    "RMSNorm",
    "RMSNormRef",
    "empty_cache",
    "fused_add_rms_norm",
    "final_norm",
    "fused_add_rms_norm_",
    "fused_add_rms_norm_fp8",
    "fused_add_rms_norm_ref",
    "load_norms",
    "mla_latent_norms",
    "patch",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_ref",
]
__version__ = "0.1.0"
