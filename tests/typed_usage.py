"""A type-checked user's code: test_typing.py runs ``mypy --strict`` on this file and expects no error.

It is never imported or run. ``assert_type`` holds the public API to the types a user relies on
(a call that came back ``Any`` would fail it), and each ``# type: ignore[code]`` marks a misuse the
annotations must catch: under ``--strict`` an ignore that stops being needed is itself an error.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn
from typing_extensions import assert_type

import dsnorm
import dsnorm.distributed
from dsnorm import sites
from dsnorm.checkpoint import LoadReport
from dsnorm.patching import PatchEntry, PatchReport, PromotingHFRMSNorm

Pair = tuple[torch.Tensor, torch.Tensor]


class Widened(dsnorm.RMSNorm):
    # A subclass overriding forward with the base's signature and return type is accepted as is.
    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Pair]:
        return super().forward(x.float(), residual)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm = dsnorm.RMSNorm(dim)
        self.ffn_norm = dsnorm.RMSNorm(dim, 1e-6, cast="hf", residual_dtype=torch.float32, device="cpu")
        self.from_config = dsnorm.RMSNorm(np.int64(dim))  # what operator.index takes, as the reference

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> Pair:
        if residual is None:
            return self.attn_norm(x), x
        y, residual = self.ffn_norm(x, residual)
        assert_type(residual, torch.Tensor)
        return y, residual


def functional(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, kv_a: torch.Tensor, flag: bool) -> None:
    assert_type(dsnorm.rms_norm(x, w, 1e-6, cast="deepseek"), torch.Tensor)
    assert_type(dsnorm.fused_add_rms_norm(x, r, w, residual_rounding="round_first"), Pair)
    assert_type(dsnorm.fused_add_rms_norm_(x, r, w), Pair)
    assert_type(dsnorm.final_norm(x, r, w, last_only=True), Pair)
    assert_type(dsnorm.mla_latent_norms(x, kv_a, w, w[:512]), Pair)
    assert_type(dsnorm.rms_norm_fp8(x, w, scale_fmt="ue8m0"), Pair)
    assert_type(dsnorm.rms_norm_fp8(x, w, return_normed=True), tuple[torch.Tensor, torch.Tensor, torch.Tensor])
    assert_type(dsnorm.rms_norm_fp8(x, w, return_normed=flag), tuple[torch.Tensor, ...])
    assert_type(dsnorm.fused_add_rms_norm_fp8(x, r, w), tuple[torch.Tensor, torch.Tensor, torch.Tensor])
    assert_type(dsnorm.fused_add_rms_norm_fp8(x, r, w, return_normed=True),
                tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor])
    assert_type(dsnorm.rms_norm_ref(x, w), torch.Tensor)
    assert_type(dsnorm.fused_add_rms_norm_ref(x, r, w), Pair)

    y: torch.Tensor = dsnorm.fused_add_rms_norm(x, r, w)  # type: ignore[assignment]
    q, s = dsnorm.rms_norm_fp8(x, w, return_normed=True)  # type: ignore[misc]


def module(norm: dsnorm.RMSNorm, x: torch.Tensor, r: torch.Tensor, maybe_r: Optional[torch.Tensor]) -> None:
    assert_type(norm(x), torch.Tensor)
    assert_type(norm(x, r), Pair)
    assert_type(norm(x, maybe_r), Union[torch.Tensor, Pair])
    assert_type(norm.forward(x, r), Union[torch.Tensor, Pair])
    assert_type(norm.weight, nn.Parameter)
    y: torch.Tensor = norm(x, r)  # type: ignore[assignment]
    dsnorm.RMSNorm(64, device=torch.float32)  # type: ignore[arg-type]


def model_tools(model: nn.Module, path: Union[str, os.PathLike[str]]) -> None:
    report = dsnorm.patch(model, probe=True)
    assert_type(report, PatchReport)
    assert_type(report.replaced, list[PatchEntry])
    assert_type(dsnorm.load_norms(model, path), LoadReport)
    dsnorm.load_norms("model", path)  # type: ignore[arg-type]


def catalog(path: str) -> None:
    cfg = sites.load_config(path)
    assert_type(cfg, sites.ModelConfig)
    assert_type(sites.enumerate_sites(cfg, mtp=False), list[sites.Site])
    assert_type(sites.summarise(sites.enumerate_sites(cfg)), list[sites.SiteSummary])
    assert_type(sites.catalog(cfg), dict[str, Any])
    assert_type(sites.config_file(path), str)
    assert_type(sites.config_file(None), None)
    assert_type(sites.totals(cfg, tuple(sites.enumerate_sites(cfg))), dict[str, Any])


def tensor_parallel() -> None:
    from torch.distributed.tensor.parallel import SequenceParallel

    assert_type(dsnorm.distributed.SequenceParallel, type[SequenceParallel])


def phf(n: PromotingHFRMSNorm) -> None:
    assert_type(n.gain_dtype, torch.dtype)
    assert_type(n.weight, nn.Parameter)
