"""The providers in the table's order (:data:`PROVIDERS`, ``(name, build)`` pairs), vLLM's own norms
among them where vLLM is installed, and the peers that run on CUDA only (:data:`CUDA_ONLY`)."""

from __future__ import annotations

from dsnorm.bench.providers import (
    COMPILED,
    DSNORM,
    FLOOR,
    REFERENCE,
    VLLM,
    build_compiled,
    build_dsnorm,
    build_f_rms_norm,
    build_flashinfer,
    build_floor,
    build_liger,
    build_quack,
    build_reference,
    build_vllm,
)

# vLLM's own norms (native eager and compiled, its C++ build, dsnorm as its provider), each with
# its fidelity against vLLM's definition, where vLLM is installed (built on dsnorm.bench.providers).
from dsnorm.integrations.vllm_bench import peers as _vllm_peers

# Timing order within a round rotates, so this order only fixes the table's.
PROVIDERS = (
    (REFERENCE, build_reference),
    (COMPILED, build_compiled),
    ("F.rms_norm", build_f_rms_norm),
    (VLLM, build_vllm),
    *_vllm_peers(),
    ("flashinfer", build_flashinfer),
    ("liger", build_liger),
    ("quack", build_quack),
    (FLOOR, build_floor),
    (DSNORM, build_dsnorm),
)
CUDA_ONLY = {"flashinfer", "liger", "quack"}
