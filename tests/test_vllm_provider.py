"""The ``dsnorm`` provider of vLLM's norm IR ops: registered by the entry point, bit for bit
vLLM's ``native`` definition at DeepSeek's layouts, declining what it does not serve, traceable."""

import importlib.metadata
import itertools
import logging
import subprocess
import sys

import pytest
import torch

from conftest import bits_equal, require_extra

require_extra("vllm", "vllm")
from vllm.ir import ops as ir_ops  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _impls(name):
    op = getattr(ir_ops, name)
    return op.impls["native"], op.impls["dsnorm"]


def _deepseek_layouts(rows, dtype):
    """q_a (columns 0-1535 of a 2112-wide row), kv_a (512 columns from 1536 of that row), hidden 7168."""
    g = torch.Generator().manual_seed(rows)
    row = (torch.randn(rows, 2112, generator=g) * 3).to(dtype)
    q, kv = row[:, :1536], row[:, 1536:2048]
    assert q.stride() == kv.stride() == (2112, 1)
    return [q, kv, torch.randn(rows, 7168, generator=g).to(dtype)]


def test_entry_point_registers_only():
    names = [ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "dsnorm"]
    assert names == ["dsnorm.integrations.vllm:register"]
    code = ("import sys, logging; logging.basicConfig(level=logging.INFO); from vllm.plugins import load_general_plugins; load_general_plugins();"
            "from vllm.ir import ops; print(sorted(ops.rms_norm.impls), sorted(ops.fused_add_rms_norm.impls),"
            " ops.rms_norm.get_priority(), ops.fused_add_rms_norm.get_priority(), 'dsnorm.cpu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    # Both ops served, no priority changed, dsnorm's kernels (numba) not loaded.
    assert last == "['dsnorm', 'native'] ['dsnorm', 'native'] [] [] False", last
    assert "registered provider 'dsnorm' for vllm.ir.ops rms_norm and fused_add_rms_norm on cpu" in out.stdout + out.stderr


def test_register_twice_is_a_no_op():
    from dsnorm.integrations import vllm as provider

    before = ir_ops.rms_norm.impls["dsnorm"]
    provider.register()
    assert ir_ops.rms_norm.impls["dsnorm"] is before


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_kind", ["model", "fp32"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bitwise_equal_to_native(dtype, weight_kind, rows):
    nat_plain, ds_plain = _impls("rms_norm")
    nat_fused, ds_fused = _impls("fused_add_rms_norm")
    assert ds_fused.inplace and not ds_plain.inplace
    for x in _deepseek_layouts(rows, dtype):
        n = x.shape[-1]
        g = torch.Generator().manual_seed(n)
        w = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype if weight_kind == "model" else torch.float32)
        eps = 1e-6
        assert ds_plain.supports_args(x, w, eps)
        assert bits_equal(ds_plain.impl_fn(x, w, eps), nat_plain.impl_fn(x, w, eps))
        res = torch.randn(x.shape, generator=g).to(dtype)
        y_ref, r_ref = nat_fused.impl_fn(x, res, w, eps)
        assert ds_fused.supports_args(x, res, w, eps)
        # The default (functional) overload: vLLM clones the activations; the inputs stay untouched.
        x0, res0 = x.clone(), res.clone()
        y, r = ds_fused.func_impl_fn(x, res, w, eps)
        assert bits_equal(y, y_ref) and bits_equal(r, r_ref)
        assert torch.equal(x, x0) and torch.equal(res, res0)
        # In place: y into x, the sum into x_residual, the same tensors returned.
        xi, ri = x.clone(), res.clone()
        y, r = ds_fused.impl_fn(xi, ri, w, eps)
        assert y is xi and r is ri
        assert bits_equal(xi, y_ref) and bits_equal(ri, r_ref)


def test_declines_what_it_does_not_serve():
    _, ds_plain = _impls("rms_norm")
    _, ds_fused = _impls("fused_add_rms_norm")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64)
    assert ds_plain.supports_args(x, w, 1e-6) and ds_plain.supports_args(x, w.bfloat16(), 1e-6)
    declined = [
        (x, None, 1e-6, None),  # no weight
        (x, w, 1e-6, 32),  # variance over a prefix
        (x, w.half(), 1e-6, None),  # a weight of another narrow dtype
        (x.float(), w.bfloat16(), 1e-6, None),  # native rounds fp32 x to the bf16 weight's dtype
        (x.double(), w.double(), 1e-6, None),  # dsnorm computes fp64 in fp64
        (x, torch.ones(32), 1e-6, None),  # weight of another width
        (x, w, 0.0, None),  # eps dsnorm refuses
        (x, w, 1e-46, None),  # rounds to 0 in float32
    ]
    for args in declined:
        assert not ds_plain.supports_args(*args), args
        assert not ds_fused.supports_args(args[0], args[0].clone(), *args[1:]), args
    assert not ds_fused.supports_args(x, x.float(), w, 1e-6)  # residual buffer of another dtype
    assert not ds_plain.supports_args(x.to("meta"), w.to("meta"), 1e-6)  # a device it does not serve


def test_declined_calls_run_native_through_the_op():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    with ir_ops.rms_norm.set_priority(["dsnorm", "native"]):
        assert ir_ops.rms_norm.dispatch(x, w, 1e-6).provider == "dsnorm"
        assert ir_ops.rms_norm.dispatch(x, w, 1e-6, 32).provider == "native"
        assert bits_equal(ir_ops.rms_norm(x, w, 1e-6, 32), ir_ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6, 32))


def test_traced_by_dynamo_as_the_cpu_engine_compiles():
    # The CPU platform compiles with ir_enable_torch_wrap=False: Dynamo traces into the chosen impl
    # (fullgraph), and dsnorm's ops must land in the graph as calls.
    from vllm.ir import enable_torch_wrap

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, residual, w):
        y = ir_ops.rms_norm(x, w, 1e-6)
        return ir_ops.fused_add_rms_norm.maybe_inplace(y, residual, w, 1e-6)

    x = torch.randn(5, 7168, dtype=torch.bfloat16)
    residual = torch.randn(5, 7168, dtype=torch.bfloat16)
    w = (torch.randn(7168) * 0.3 + 1).bfloat16()
    prio = (["dsnorm", "native"],) * 2
    with enable_torch_wrap(False), ir_ops.rms_norm.set_priority(prio[0]), \
            ir_ops.fused_add_rms_norm.set_priority(prio[1]):
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend, fullgraph=True)
        y, r = compiled(x.clone(), residual.clone(), w)
    code = "\n".join(g.code for g in graphs)
    assert "torch.ops.dsnorm" in code and "native" not in code, code
    y0 = ir_ops.rms_norm.impls["native"].impl_fn(x, w, 1e-6)
    y_ref, r_ref = ir_ops.fused_add_rms_norm.impls["native"].impl_fn(y0, residual, w, 1e-6)
    assert bits_equal(y, y_ref) and bits_equal(r, r_ref)


def test_missing_vllm_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm.ir" or name.startswith("vllm.ir."):
            raise ImportError("No module named 'vllm.ir'")
        return real_import(name, *args, **kwargs)

    from dsnorm.integrations import vllm as provider

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    provider.logger.addHandler(handler)
    monkeypatch.setattr(builtins, "__import__", no_vllm)
    try:
        provider.register()
    finally:
        provider.logger.removeHandler(handler)
    assert any("has no vllm.ir" in r.getMessage() for r in records)


def test_cli_priority_as_the_docs_write_it():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--ir-op-priority",
                              '{"rms_norm": ["dsnorm"], "fused_add_rms_norm": ["dsnorm"]}'])
    assert args.ir_op_priority.rms_norm == ["dsnorm"] and args.ir_op_priority.fused_add_rms_norm == ["dsnorm"]
