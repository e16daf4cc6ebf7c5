"""Every entry point tries the CPU fast lane once per call; the light commands and the CUDA impls
import no numba."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import dsnorm
from conftest import bits_equal
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref


class LaneAttempts:
    """The one internal hook: the fast lane's attempts, counted by wrapping ``dsnorm.ops.lane``,
    which every entry point reads when it tries the lane (the module, the functions, the ops' CPU
    impls)."""

    @staticmethod
    def count(monkeypatch) -> list:
        from dsnorm import ops

        lane = ops.lane or ops._load_lane()
        attempts = []

        def counted(form, *args):
            attempts.append(int(form))
            return lane(form, *args)

        monkeypatch.setattr(ops, "lane", counted)
        return attempts

    @staticmethod
    def op_impl(name):
        """The CPU impl registered for ``torch.ops.dsnorm.<name>``, called without the dispatcher."""
        from dsnorm import ops

        return ops.IMPLS["CPU"][name]


PLAIN, FUSED, INPLACE = 0, 1, 2
N = 64


def _data(dtype, seed, shape=(2, 1, N)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _hooked(norm):
    norm.register_forward_pre_hook(lambda module, args: None)  # the module's fast path is off
    return norm


# (entry, form, call(x, residual, weight)); ``weight`` is fp32, widened for the ops as needed.
def _op_weight(x, w):
    return w.to(torch.float64) if x.dtype == torch.float64 else w


ENTRIES = [
    ("module", PLAIN, lambda x, r, w: dsnorm.RMSNorm(N)(x)),
    ("module", FUSED, lambda x, r, w: dsnorm.RMSNorm(N)(x, r)),
    ("module with a hook", PLAIN, lambda x, r, w: _hooked(dsnorm.RMSNorm(N))(x)),
    ("module with a hook", FUSED, lambda x, r, w: _hooked(dsnorm.RMSNorm(N))(x, r)),
    ("function", PLAIN, lambda x, r, w: dsnorm.rms_norm(x, w)),
    ("function", FUSED, lambda x, r, w: dsnorm.fused_add_rms_norm(x, r, w)),
    ("function", INPLACE, lambda x, r, w: dsnorm.fused_add_rms_norm_(x, r, w)),
    ("torch.ops", PLAIN, lambda x, r, w: torch.ops.dsnorm.rms_norm(x, _op_weight(x, w), 1e-6, "deepseek")),
    ("torch.ops", FUSED, lambda x, r, w: torch.ops.dsnorm.fused_add_rms_norm(
        x, r, _op_weight(x, w), 1e-6, "deepseek", "fp32_sum", None)),
    ("torch.ops", INPLACE, lambda x, r, w: torch.ops.dsnorm.fused_add_rms_norm_(
        x, r, _op_weight(x, w), 1e-6, "deepseek", "fp32_sum")),
    ("op impl", PLAIN, lambda x, r, w: LaneAttempts.op_impl("rms_norm")(x, _op_weight(x, w), 1e-6, "deepseek")),
    ("op impl", FUSED, lambda x, r, w: LaneAttempts.op_impl("fused_add_rms_norm")(
        x, r, _op_weight(x, w), 1e-6, "deepseek", "fp32_sum", None)),
    ("op impl", INPLACE, lambda x, r, w: LaneAttempts.op_impl("fused_add_rms_norm_")(
        x, r, _op_weight(x, w), 1e-6, "deepseek", "fp32_sum")),
]


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "declined"])
@pytest.mark.parametrize("entry, form, call", ENTRIES, ids=[f"{e}-{f}" for e, f, _ in ENTRIES])
def test_each_entry_point_tries_the_fast_lane_once(monkeypatch, entry, form, call, taken):
    # bf16 rows the lane takes; fp64 rows it declines (the general path computes them).
    dtype = torch.bfloat16 if taken else torch.float64
    x, r, w = _data(dtype, 1), _data(dtype, 2), torch.ones(N)
    want = rms_norm_ref(x, w) if form == PLAIN else fused_add_rms_norm_ref(x, r, w)
    xi, ri = x.clone(), r.clone()
    with torch.no_grad():
        attempts = LaneAttempts.count(monkeypatch)
        out = call(xi, ri, w)
    assert attempts == [form], (entry, attempts)
    got = (xi, ri) if form == INPLACE else out
    if form == PLAIN:
        assert bits_equal(got, want)
    else:
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])


def test_a_training_call_tries_the_fast_lane_once(monkeypatch):
    x, r = _data(torch.float32, 1).requires_grad_(), _data(torch.float32, 2)
    norm = dsnorm.RMSNorm(N)
    attempts = LaneAttempts.count(monkeypatch)
    y, _ = norm(x, r)  # the lane declines (a gradient to record); the training path takes it
    z = dsnorm.rms_norm(x, norm.weight)
    assert attempts == [FUSED, PLAIN]
    (y.sum() + z.sum()).backward()
    assert x.grad is not None and norm.weight.grad is not None


def _imported_after(code: str) -> list:
    script = textwrap.dedent(code) + textwrap.dedent(
        """
        import sys
        print([m for m in ("numba", "triton", "dsnorm.cpu", "dsnorm.triton") if m in sys.modules])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_sites_and_count_import_neither_numba_nor_triton(tmp_path):
    # A one-tensor checkpoint: count reads it and reports the norms the config has that it lacks (1).
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    assert _imported_after(
        f"""
        from dsnorm import cli
        assert cli.main(["sites"]) == 0
        assert cli.main(["count", {str(tmp_path)!r}]) == 1
        """
    ) == "[]"


def test_the_cuda_impls_do_not_load_the_cpu_lane():
    # No GPU here: the CUDA impls are called with meta tensors, which pass their checks and stop at
    # the launcher lookup (no kernels for meta). Loading the CPU lane on the way would import numba.
    assert _imported_after(
        """
        import torch
        from dsnorm import ops

        x = torch.empty(2, 8, device="meta")
        w = torch.empty(8, device="meta")
        impls = ops.IMPLS["CUDA"]
        calls = [
            lambda: impls["rms_norm"](x, w, 1e-6, "deepseek"),
            lambda: impls["fused_add_rms_norm"](x, x.clone(), w, 1e-6, "deepseek", "fp32_sum", None),
            lambda: impls["fused_add_rms_norm_"](x, torch.empty(2, 8, device="meta"), w, 1e-6, "deepseek",
                                                 "fp32_sum"),
        ]
        for call in calls:
            try:
                call()
            except (NotImplementedError, ValueError) as e:
                assert "meta" in str(e) or "share memory" in str(e), e
            else:
                raise AssertionError("a meta tensor reached a kernel")
        assert ops.lane is None
        """
    ) == "[]"
