"""DTensor support (dsnorm.distributed): spawned gloo CPU processes on loopback.

One spawn per file: three worker processes (world size 3) run every check, on the 3-rank mesh and
on a 2-rank sub-mesh (ranks 0 and 1), and write their results to JSON; the tests below read them.
The workers are this file run as a script (``python tests/test_distributed.py``), so nothing
depends on how pytest imports test modules.

Rows are independent, so sharded results must equal the single-process result bit for bit;
``dweight`` is a ``Partial`` sum whose parts add in another order (within 1e-6 relative).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

WORLD = 3
SUB = 2  # the sub-mesh: ranks 0..SUB-1
TIMEOUT_S = 240

CHECKS = {}  # name -> function(mesh)


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# Worker side


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=_gen(seed)).to(dtype)


def _no_comm(cm):
    counts = cm.get_total_counts()
    assert counts == 0, f"expected no collective, got {counts}: {dict(cm.get_comm_counts())}"


def _bitwise(a, b, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (
        f"{what}: not bitwise equal, max diff {(a.double() - b.double()).abs().max().item()}"
    )


def _rel_close(a, b, what, rel=1e-6):
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= rel * scale, f"{what}: max error {err} > {rel} * {scale}"


def _row_placements(x_ndim):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0), Shard(1), Replicate()] if x_ndim > 2 else [Shard(0), Replicate()]


@check
def forward_inference(mesh):
    """rms_norm: every row placement runs locally, keeps its placement, equals one process bitwise."""
    import dsnorm
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    # uneven shards on 2 and 3 ranks, a batch of 1 (empty shards), 2-D input, bf16 gain
    cases = [((3, 7, 64), torch.bfloat16, torch.float32), ((3, 7, 40), torch.float32, torch.float32),
             ((1, 5, 64), torch.bfloat16, torch.float32), ((7, 48), torch.float16, torch.bfloat16),
             ((2, 6, 32), torch.bfloat16, torch.bfloat16)]
    for k, (shape, dtype, wdtype) in enumerate(cases):
        x = _randn(shape, dtype, 10 + k)
        w = (1 + 0.5 * _randn(shape[-1:], torch.float32, 20 + k)).to(wdtype)
        for cast in ("deepseek", "hf"):
            ref = dsnorm.rms_norm(x, w, cast=cast)
            dw = distribute_tensor(w, mesh, [Replicate()])
            for pl in _row_placements(len(shape)):
                dx = distribute_tensor(x, mesh, [pl])
                with CommDebugMode() as cm:
                    y = dsnorm.rms_norm(dx, dw, cast=cast)
                _no_comm(cm)
                assert tuple(y.placements) == (pl,), (shape, pl, y.placements)
                _bitwise(y.full_tensor(), ref, f"y {shape} {dtype} {cast} {pl}")


@check
def fused_forward_inference(mesh):
    """fused_add_rms_norm: y and residual_out keep x's placement, bitwise, no collective."""
    import dsnorm
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    x = _randn((3, 7, 64), torch.bfloat16, 1)
    w = 1 + 0.5 * _randn((64,), torch.float32, 2)
    dw = distribute_tensor(w, mesh, [Replicate()])
    variants = [dict(), dict(residual_dtype=torch.float32), dict(residual_rounding="round_first"),
                dict(cast="hf"), dict()]  # the last repeats the first: the sharding cache must
    for opts in variants:              # not reuse the fp32-residual metadata
        rdtype = opts.get("residual_dtype") or torch.bfloat16
        r = _randn((3, 7, 64), rdtype, 3)
        ref_y, ref_r = dsnorm.fused_add_rms_norm(x, r, w, **opts)
        for pl in _row_placements(3):
            dx, dr = distribute_tensor(x, mesh, [pl]), distribute_tensor(r, mesh, [pl])
            with CommDebugMode() as cm:
                y, r_out = dsnorm.fused_add_rms_norm(dx, dr, dw, **opts)
            _no_comm(cm)
            assert tuple(y.placements) == (pl,) and tuple(r_out.placements) == (pl,)
            assert r_out.dtype == rdtype and r_out.to_local().dtype == rdtype, (opts, r_out.dtype)
            _bitwise(y.full_tensor(), ref_y, f"y {opts} {pl}")
            _bitwise(r_out.full_tensor(), ref_r, f"residual_out {opts} {pl}")


@check
def inplace(mesh):
    """fused_add_rms_norm_ writes each shard in place; mismatched placements are refused."""
    import dsnorm
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    x = _randn((3, 6, 64), torch.bfloat16, 4)
    w = 1 + 0.5 * _randn((64,), torch.float32, 5)
    for rdtype in (torch.bfloat16, torch.float32):
        r = _randn((3, 6, 64), rdtype, 6)
        ref_x, ref_r = x.clone(), r.clone()
        dsnorm.fused_add_rms_norm_(ref_x, ref_r, w)
        for pl in _row_placements(3):
            dx, dr = distribute_tensor(x, mesh, [pl]), distribute_tensor(r, mesh, [pl])
            local_x, local_r = dx.to_local(), dr.to_local()
            dw = distribute_tensor(w, mesh, [Replicate()])
            with torch.no_grad(), CommDebugMode() as cm:
                out = dsnorm.fused_add_rms_norm_(dx, dr, dw)
            _no_comm(cm)
            assert out[0] is dx and out[1] is dr
            assert dx.to_local().data_ptr() == local_x.data_ptr() and dr.to_local().data_ptr() == local_r.data_ptr()
            assert tuple(dx.placements) == (pl,) and tuple(dr.placements) == (pl,)
            _bitwise(dx.full_tensor(), ref_x, f"x in place {rdtype} {pl}")
            _bitwise(dr.full_tensor(), ref_r, f"residual in place {rdtype} {pl}")
    dx, dr = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(x, mesh, [Shard(1)])
    with pytest.raises(Exception, match="in place, x and residual must have the same"):
        with torch.no_grad():
            dsnorm.fused_add_rms_norm_(dx, dr, distribute_tensor(w, mesh, [Replicate()]))


@check
def training_rms_norm(mesh):
    """Autograd through DTensor: forward without collective, dx bitwise, dweight Partial then close."""
    import dsnorm
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    for shape, dtype in (((3, 7, 64), torch.bfloat16), ((5, 48), torch.float32)):
        x = _randn(shape, dtype, 7)
        w = 1 + 0.5 * _randn(shape[-1:], torch.float32, 8)
        g = _randn(shape, dtype, 9)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = dsnorm.rms_norm(xr, wr)
        yr.backward(g)
        for pl in _row_placements(len(shape)):
            dx = distribute_tensor(x, mesh, [pl]).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            with CommDebugMode() as cm:
                y = dsnorm.rms_norm(dx, dw)
            _no_comm(cm)
            assert tuple(y.placements) == (pl,)
            y.backward(distribute_tensor(g, mesh, [pl]))
            want = (Replicate(),) if pl == Replicate() else (Partial(),)
            assert tuple(dw.grad.placements) == want, (pl, dw.grad.placements)
            assert tuple(dx.grad.placements) == (pl,)
            _bitwise(y.full_tensor(), yr.detach(), f"y {shape} {pl}")
            _bitwise(dx.grad.full_tensor(), xr.grad, f"dx {shape} {pl}")
            _rel_close(dw.grad.full_tensor(), wr.grad, f"dweight {shape} {pl}")


@check
def training_fused(mesh):
    """fused_add_rms_norm backward: dx and dresidual bitwise, dweight within 1e-6 relative."""
    import dsnorm
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    shape = (3, 7, 64)
    x = _randn(shape, torch.bfloat16, 11)
    w = 1 + 0.5 * _randn((64,), torch.float32, 12)
    gy = _randn(shape, torch.bfloat16, 13)
    for opts in (dict(), dict(residual_dtype=torch.float32), dict(residual_rounding="round_first")):
        rdtype = opts.get("residual_dtype") or torch.bfloat16
        r = _randn(shape, rdtype, 14)
        gr = _randn(shape, rdtype, 15)
        xr, rr, wr = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
        torch.autograd.backward(dsnorm.fused_add_rms_norm(xr, rr, wr, **opts), (gy, gr))
        for pl in _row_placements(3):
            dx = distribute_tensor(x, mesh, [pl]).requires_grad_()
            dr = distribute_tensor(r, mesh, [pl]).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            with CommDebugMode() as cm:
                y, r_out = dsnorm.fused_add_rms_norm(dx, dr, dw, **opts)
            _no_comm(cm)
            assert tuple(y.placements) == (pl,) and tuple(r_out.placements) == (pl,)
            torch.autograd.backward((y, r_out), (distribute_tensor(gy, mesh, [pl]), distribute_tensor(gr, mesh, [pl])))
            want = (Replicate(),) if pl == Replicate() else (Partial(),)
            assert tuple(dw.grad.placements) == want
            _bitwise(dx.grad.full_tensor(), xr.grad, f"dx {opts} {pl}")
            _bitwise(dr.grad.full_tensor(), rr.grad, f"dresidual {opts} {pl}")
            _rel_close(dw.grad.full_tensor(), wr.grad, f"dweight {opts} {pl}")
    # Only y used (the final norm's new residual stream is dropped): no gradient reaches
    # residual_out. Autograd used to fill one in as a plain zero tensor, which a DTensor backward
    # refused ("mixed torch.Tensor and DTensor").
    r = _randn(shape, torch.bfloat16, 14)
    xr, rr, wr = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    dsnorm.fused_add_rms_norm(xr, rr, wr)[0].backward(gy)
    for pl in _row_placements(3):
        dx = distribute_tensor(x, mesh, [pl]).requires_grad_()
        dr = distribute_tensor(r, mesh, [pl]).requires_grad_()
        dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        dsnorm.fused_add_rms_norm(dx, dr, dw)[0].backward(distribute_tensor(gy, mesh, [pl]))
        _bitwise(dx.grad.full_tensor(), xr.grad, f"dx, y only, {pl}")
        _bitwise(dr.grad.full_tensor(), rr.grad, f"dresidual, y only, {pl}")
        _rel_close(dw.grad.full_tensor(), wr.grad, f"dweight, y only, {pl}")


@check
def direct_ops(mesh):
    """The training ops called directly: rstd keeps x's row placement, dweight comes back Partial."""
    import dsnorm
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    ops = torch.ops.dsnorm
    shape = (2, 6, 32)
    x, r, dy = (_randn(shape, torch.bfloat16, s) for s in (21, 22, 23))
    w = 1 + 0.5 * _randn((32,), torch.float32, 24)
    y0, rstd0 = ops.rms_norm_fwd(x, w, 1e-6, "deepseek")
    dx0, dw0 = ops.rms_norm_bwd(dy, x, w, rstd0)
    fy0, fr0, frstd0 = ops.fused_add_rms_norm_fwd(x, r, w, 1e-6, "deepseek", "fp32_sum", None)
    fdx0, fdr0, fdw0 = ops.fused_add_rms_norm_bwd(dy, x, r, w, frstd0, None, "fp32_sum")
    dw_ = distribute_tensor(w, mesh, [Replicate()])
    for pl in (Shard(0), Shard(1)):
        dx_, dr_, ddy = (distribute_tensor(t, mesh, [pl]) for t in (x, r, dy))
        y, rstd = ops.rms_norm_fwd(dx_, dw_, 1e-6, "deepseek")
        assert tuple(rstd.placements) == (pl,) and rstd.shape == shape[:-1]
        dx, dw = ops.rms_norm_bwd(ddy, dx_, dw_, rstd)
        assert tuple(dx.placements) == (pl,) and tuple(dw.placements) == (Partial(),)
        fy, fr, frstd = ops.fused_add_rms_norm_fwd(dx_, dr_, dw_, 1e-6, "deepseek", "fp32_sum", None)
        fdx, fdr, fdw = ops.fused_add_rms_norm_bwd(ddy, dx_, dr_, dw_, frstd, None, "fp32_sum")
        assert tuple(fdw.placements) == (Partial(),) and tuple(fdr.placements) == (pl,)
        for a, b, what in ((y, y0, "y"), (rstd, rstd0, "rstd"), (dx, dx0, "dx"), (fy, fy0, "fused y"),
                           (fr, fr0, "fused residual_out"), (frstd, frstd0, "fused rstd"),
                           (fdx, fdx0, "fused dx"), (fdr, fdr0, "fused dresidual")):
            _bitwise(a.full_tensor(), b, f"{what} {pl}")
        _rel_close(dw.full_tensor(), dw0, f"dweight {pl}")
        _rel_close(fdw.full_tensor(), fdw0, f"fused dweight {pl}")
    # a dy placed differently from x is redistributed to x's placement (that one is a collective)
    dx, dw = ops.rms_norm_bwd(distribute_tensor(dy, mesh, [Replicate()]), distribute_tensor(x, mesh, [Shard(1)]),
                              dw_, distribute_tensor(rstd0, mesh, [Shard(1)]))
    assert tuple(dx.placements) == (Shard(1),)
    _bitwise(dx.full_tensor(), dx0, "dx with replicated dy")
    # a residual placed differently is redistributed to x's placement; a Partial x is reduced first
    x_s1, r_rep = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(r, mesh, [Replicate()])
    y, r_out = dsnorm.fused_add_rms_norm(x_s1, r_rep, dw_)
    assert tuple(y.placements) == (Shard(1),) and tuple(r_out.placements) == (Shard(1),)
    _bitwise(y.full_tensor(), fy0, "y with replicated residual")
    xp = DTensor.from_local(_randn(shape, torch.bfloat16, 25 + mesh.get_local_rank()), mesh, [Partial()])
    y = dsnorm.rms_norm(xp, dw_)
    assert tuple(y.placements) == (Replicate(),)
    _bitwise(y.to_local(), dsnorm.rms_norm(xp.full_tensor(), w), "y of a Partial x")


@check
def mesh_2d(mesh):
    """A 2-D mesh (1 x n): placements per mesh dim, dweight Partial only where x is sharded."""
    import dsnorm
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh2d = DeviceMesh("cpu", mesh.mesh.view(1, -1))
    x = _randn((4, 6, 32), torch.bfloat16, 31)
    w = 1 + 0.5 * _randn((32,), torch.float32, 32)
    g = _randn((4, 6, 32), torch.bfloat16, 33)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    dsnorm.rms_norm(xr, wr).backward(g)
    for pls in ((Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate())):
        dx = distribute_tensor(x, mesh2d, pls).requires_grad_()
        dw = distribute_tensor(w, mesh2d, [Replicate(), Replicate()]).requires_grad_()
        with CommDebugMode() as cm:
            y = dsnorm.rms_norm(dx, dw)
        _no_comm(cm)
        assert tuple(y.placements) == pls
        y.backward(distribute_tensor(g, mesh2d, pls))
        assert tuple(dw.grad.placements) == tuple(Partial() if isinstance(p, Shard) else Replicate() for p in pls)
        _bitwise(y.full_tensor(), dsnorm.rms_norm(x, w), f"y {pls}")
        _bitwise(dx.grad.full_tensor(), xr.grad, f"dx {pls}")
        _rel_close(dw.grad.full_tensor(), wr.grad, f"dweight {pls}")


@check
def refusals(mesh):
    """A shard of the normalised dimension (or of the gain) is refused, naming what to use."""
    import dsnorm
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = _randn((2, 6, 30), torch.bfloat16, 41)
    w = torch.ones(30)
    dw = distribute_tensor(w, mesh, [Replicate()])
    msg = r"sharded on its last dimension.*RMSNorm normalises over.*Shard\(0\) or Shard\(1\).*Replicate\(\)"
    with pytest.raises(Exception, match=msg):
        dsnorm.rms_norm(distribute_tensor(x, mesh, [Shard(2)]), dw)
    with pytest.raises(Exception, match=msg):  # the training path too
        dsnorm.rms_norm(distribute_tensor(x, mesh, [Shard(-1)]).requires_grad_(), dw)
    with pytest.raises(Exception, match=r"residual of shape .* sharded on its last dimension"):
        dsnorm.fused_add_rms_norm(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(x, mesh, [Shard(2)]), dw)
    with pytest.raises(Exception, match=r"last dimension.*Use Replicate\(\): a 1-D x has no row dimension"):
        dsnorm.rms_norm(distribute_tensor(x[0, 0], mesh, [Shard(0)]), dw)
    with pytest.raises(Exception, match=r"weight must be Replicate\(\) on every mesh dim.*fully_shard"):
        dsnorm.rms_norm(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)]))


@check
def fusions(mesh):
    """fp8, MLA and final-norm fusions: row placements run locally, bitwise; a sequence-split
    final_norm and a last-dim shard are refused by name."""
    import pytest

    import dsnorm
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    x, r = _randn((3, 5, 256), torch.bfloat16, 91), _randn((3, 5, 256), torch.bfloat16, 92)
    w = 1 + 0.5 * _randn((256,), torch.float32, 93)
    kv = _randn((3, 5, 160), torch.bfloat16, 94)
    wkv = 1 + 0.5 * _randn((128,), torch.float32, 95)
    lengths = torch.tensor([5, 2, 4])
    dw, dwkv = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(wkv, mesh, [Replicate()])

    def same(got, want, what):
        # Each rank's shard against the same shard of the single-process result (gloo cannot gather
        # fp8, so no full_tensor()).
        for g, e in zip(got, want):
            placements = g.placements
            _bitwise(g.to_local().view(torch.uint8), distribute_tensor(e.view(torch.uint8), mesh, placements).to_local(),
                     what)

    for return_normed in (False, True):
        want = dsnorm.rms_norm_fp8(x, w, block_size=128, return_normed=return_normed)
        want_fused = dsnorm.fused_add_rms_norm_fp8(x, r, w, block_size=128, return_normed=return_normed)
        for pl in _row_placements(3):
            dx, dr = distribute_tensor(x, mesh, [pl]), distribute_tensor(r, mesh, [pl])
            with CommDebugMode() as cm:
                got = dsnorm.rms_norm_fp8(dx, dw, block_size=128, return_normed=return_normed)
                got_fused = dsnorm.fused_add_rms_norm_fp8(dx, dr, dw, block_size=128, return_normed=return_normed)
            _no_comm(cm)
            assert all(tuple(t.placements) == (pl,) for t in got + got_fused)
            same(got, want, f"rms_norm_fp8 {pl} {return_normed}")
            same(got_fused, want_fused, f"fused_add_rms_norm_fp8 {pl} {return_normed}")
    want = dsnorm.mla_latent_norms(x, kv, w, wkv)
    for pl in _row_placements(3):
        dx, dkv = distribute_tensor(x, mesh, [pl]), distribute_tensor(kv, mesh, [pl])
        with CommDebugMode() as cm:
            got = dsnorm.mla_latent_norms(dx, dkv, dw, dwkv)
        _no_comm(cm)
        assert all(tuple(t.placements) == (pl,) for t in got)
        same(got, want, f"mla_latent_norms {pl}")
    for lens in (None, lengths):
        want = dsnorm.final_norm(x, r, w, lengths=lens)
        for pl in (Shard(0), Replicate()):
            dl = None if lens is None else distribute_tensor(lens, mesh, [pl])
            dx, dr = distribute_tensor(x, mesh, [pl]), distribute_tensor(r, mesh, [pl])
            with CommDebugMode() as cm:
                got = dsnorm.final_norm(dx, dr, dw, lengths=dl)
            _no_comm(cm)
            assert all(tuple(t.placements) == (pl,) for t in got)
            same(got, want, f"final_norm {pl} lengths={lens}")
    with pytest.raises(Exception, match=r"final_norm: h .* sharded on dimension 1 .*last position.*Shard\(0\)"):
        dsnorm.final_norm(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(r, mesh, [Shard(1)]), dw)
    with pytest.raises(Exception, match=r"rms_norm_fp8: x .* sharded on its last dimension"):
        dsnorm.rms_norm_fp8(distribute_tensor(x, mesh, [Shard(2)]), dw, block_size=128)
    with pytest.raises(Exception, match=r"mla_latent_norms: kv_a .* sharded on its last dimension"):
        dsnorm.mla_latent_norms(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(kv, mesh, [Shard(2)]),
                                dw, dwkv)


@check
def sequence_parallel(mesh):
    """torch's SequenceParallel on dsnorm.RMSNorm; dsnorm's SequenceParallel keeps the residual."""
    import dsnorm
    import dsnorm.distributed as dd
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    n, rank = mesh.size(), mesh.get_local_rank()
    shape = (2, 2 * n, 64)  # from_local assumes even shards
    x, r, gy, gr = (_randn(shape, torch.bfloat16, s) for s in (51, 52, 53, 54))
    gain = 1 + 0.5 * _randn((64,), torch.float32, 55)

    def model():
        m = torch.nn.Module()
        m.norm = dsnorm.RMSNorm(64)
        with torch.no_grad():
            m.norm.weight.copy_(gain)  # the same on every rank: SequenceParallel replicates by from_local
        return m

    def local(t):
        return t.chunk(n, dim=1)[rank]

    # plain form, torch's style
    ref = model()
    xr = x.clone().requires_grad_()
    yr = ref.norm(xr)
    yr.backward(gy)
    m = parallelize_module(model(), mesh, {"norm": SequenceParallel()})
    assert isinstance(m.norm.weight, DTensor)
    xl = local(x).clone().requires_grad_()
    with CommDebugMode() as cm:
        y = m.norm(xl)
    _no_comm(cm)
    assert tuple(y.placements) == (Shard(1),)
    y.to_local().backward(local(gy))
    assert tuple(m.norm.weight.grad.placements) == (Partial(),)
    _bitwise(y.full_tensor(), yr.detach(), "SequenceParallel y")
    _bitwise(xl.grad, local(xr.grad), "SequenceParallel dx")
    _rel_close(m.norm.weight.grad.full_tensor(), ref.norm.weight.grad, "SequenceParallel dweight")

    # fused form: dsnorm.distributed.SequenceParallel passes the residual on
    ref = model()
    xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
    torch.autograd.backward(ref.norm(xr, rr), (gy, gr))
    m = parallelize_module(model(), mesh, {"norm": dd.SequenceParallel(use_local_output=True)})
    xl, rl = local(x).clone().requires_grad_(), local(r).clone().requires_grad_()
    with CommDebugMode() as cm:
        y, r_out = m.norm(xl, rl)
    _no_comm(cm)
    assert type(y) is torch.Tensor and type(r_out) is torch.Tensor  # use_local_output
    torch.autograd.backward((y, r_out), (local(gy), local(gr)))
    wgrad = m.norm.weight.grad.full_tensor()
    ref_y, ref_r = dsnorm.fused_add_rms_norm(x, r, gain)
    _bitwise(y, local(ref_y), "SequenceParallel fused y")
    _bitwise(r_out, local(ref_r), "SequenceParallel fused residual_out")
    _bitwise(xl.grad, local(xr.grad), "SequenceParallel fused dx")
    _bitwise(rl.grad, local(rr.grad), "SequenceParallel fused dresidual")
    _rel_close(wgrad, ref.norm.weight.grad, "SequenceParallel fused dweight")


@check
def narrow_gain_gradient(mesh):
    """A bf16/fp16 gain's gradient: the ranks' fp32 parts summed in fp32, rounded once (Replicate),
    not rounded per rank and added in bf16 (Partial), which moved 20 of 64 elements 1-2 ulps."""
    import dsnorm
    from torch.distributed.tensor import Replicate, distribute_tensor

    shape = (6, 5, 64)
    x, g = _randn(shape, torch.bfloat16, 81), _randn(shape, torch.bfloat16, 82)
    for wdtype in (torch.bfloat16, torch.float16):
        w = (1 + 0.5 * _randn((64,), torch.float32, 83)).to(wdtype)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        dsnorm.rms_norm(xr, wr).backward(g)
        for pl in _row_placements(3):
            dx = distribute_tensor(x, mesh, [pl]).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            dsnorm.rms_norm(dx, dw).backward(distribute_tensor(g, mesh, [pl]))
            assert tuple(dw.grad.placements) == (Replicate(),) and dw.grad.dtype == wdtype, (pl, dw.grad.placements)
            _bitwise(dx.grad.full_tensor(), xr.grad, f"dx, {wdtype} gain, {pl}")
            # One rounding of a sum whose fp32 parts add in another order: 1 ulp at most, and
            # only where that sum lies within an fp32 rounding of a bf16/fp16 rounding boundary.
            got, want = dw.grad.full_tensor(), wr.grad
            ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 1 and int((ulps > 0).sum()) <= 2, (wdtype, pl, ulps.tolist())
    # The same compiled: the traced gradient's placement is the forward's (Replicate), not the
    # Partial it has at run time (a reduction conditioned on it was dropped from the graph).
    w = (1 + 0.5 * _randn((64,), torch.float32, 83)).bfloat16()
    wr = w.clone().requires_grad_()
    dsnorm.rms_norm(x, wr).backward(g)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        f = torch.compile(lambda a, b: dsnorm.rms_norm(a, b), backend=backend)
        for pl in _row_placements(3)[:2]:
            dx = distribute_tensor(x, mesh, [pl]).requires_grad_()
            dw = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
            f(dx, dw).backward(distribute_tensor(g, mesh, [pl]))
            assert tuple(dw.grad.placements) == (Replicate(),), (backend, pl, dw.grad.placements)
            ulps = (dw.grad.full_tensor().view(torch.int16).int() - wr.grad.view(torch.int16).int()).abs()
            assert int(ulps.max()) <= 1 and int((ulps > 0).sum()) <= 2, (backend, pl, ulps.tolist())


@check
def keyword_residual(mesh):
    """dsnorm.distributed.SequenceParallel shards a residual passed by keyword, as one passed by position."""
    import dsnorm
    import dsnorm.distributed as dd
    from torch.distributed.tensor.parallel import parallelize_module

    n, rank = mesh.size(), mesh.get_local_rank()
    shape = (2, 2 * n, 64)
    x, r = _randn(shape, torch.bfloat16, 61), _randn(shape, torch.bfloat16, 62)
    m = torch.nn.Module()
    m.norm = dsnorm.RMSNorm(64)
    m = parallelize_module(m, mesh, {"norm": dd.SequenceParallel(use_local_output=True)})
    xl, rl = x.chunk(n, dim=1)[rank], r.chunk(n, dim=1)[rank]
    want = dsnorm.fused_add_rms_norm(x, r, torch.ones(64))
    for got in (m.norm(xl, rl), m.norm(xl, residual=rl), m.norm(x=xl, residual=rl)):
        for a, b, what in zip(got, want, ("y", "residual_out")):
            _bitwise(a, b.chunk(n, dim=1)[rank], f"keyword residual {what}")
    _bitwise(m.norm(x=xl), dsnorm.rms_norm(x, torch.ones(64)).chunk(n, dim=1)[rank], "keyword x")


@check
def error_texts(mesh):
    """A sharded gain is named as the argument it is; the last-dimension error's example runs."""
    import re

    import dsnorm
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    q, kv = _randn((2, 32), torch.bfloat16, 71), _randn((2, 40), torch.bfloat16, 72)
    wq, wkv = torch.ones(32), torch.ones(16)
    with pytest.raises(Exception, match=r"kv_weight must be Replicate\(\).*kv_weight\.redistribute"):
        dsnorm.mla_latent_norms(distribute_tensor(q, mesh, [Shard(0)]), distribute_tensor(kv, mesh, [Shard(0)]),
                                distribute_tensor(wq, mesh, [Replicate()]), distribute_tensor(wkv, mesh, [Shard(0)]))
    mesh2d = DeviceMesh("cpu", mesh.mesh.view(1, -1))
    x = distribute_tensor(_randn((4, 6, 32), torch.bfloat16, 73), mesh2d, [Replicate(), Shard(2)])
    w = distribute_tensor(torch.ones(32), mesh2d, [Replicate(), Replicate()])
    with pytest.raises(Exception) as info:
        dsnorm.rms_norm(x, w)
    text = str(info.value) + str(getattr(info.value, "__cause__", ""))
    example = re.search(r"x\.redistribute\(mesh, (\[[^\]]*\])\)", text)
    assert example, text
    placements = eval(example.group(1), {"Shard": Shard, "Replicate": Replicate})  # noqa: S307 (our own message)
    assert placements == [Replicate(), Shard(0)], placements
    y = dsnorm.rms_norm(x.redistribute(mesh2d, placements), w)  # the suggestion works
    _bitwise(y.full_tensor(), dsnorm.rms_norm(x.full_tensor(), torch.ones(32)), "y after the suggested redistribute")
    # Every mesh dim's shard of the last dim is replaced, a Partial printed as what it becomes.
    from torch.distributed.tensor import DTensor, Partial

    full = _randn((4, 6, 32), torch.bfloat16, 74)
    both = distribute_tensor(full, mesh2d, [Shard(2), Shard(2)])
    partial = DTensor.from_local(both.to_local(), mesh2d, [Partial(), Shard(2)], run_check=False,
                                 shape=full.shape, stride=full.stride())
    for t, want in ((both, [Shard(0), Shard(0)]), (partial, [Replicate(), Shard(0)])):
        with pytest.raises(Exception) as info:
            dsnorm.rms_norm(t, w)
        text = str(info.value) + str(getattr(info.value, "__cause__", ""))
        example = re.search(r"x\.redistribute\(mesh, (\[[^\]]*\])\)", text)
        assert example and eval(example.group(1), {"Shard": Shard, "Replicate": Replicate}) == want, text  # noqa: S307
        dsnorm.rms_norm(t.redistribute(mesh2d, want), w)  # runs


@check
def load_norms_into_dtensors(mesh):
    """dsnorm.load_norms into FSDP2-sharded and TP-replicated gains: each rank gets its share,
    nothing mistaken for a tied parameter."""
    import tempfile

    import dsnorm
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    n_layers, d = 2, 40
    gains = {f"layers.{i}.{site}.weight": (1 + 0.5 * _randn((d,), torch.float32, 90 + 2 * i + k)).bfloat16()
             for i in range(n_layers) for k, site in enumerate(("attn_norm", "ffn_norm"))}
    gains["norm.weight"] = (1 + 0.5 * _randn((d,), torch.float32, 99)).bfloat16()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.ffn_norm = dsnorm.RMSNorm(d), dsnorm.RMSNorm(d)

        def forward(self, h):
            return self.ffn_norm(self.attn_norm(h))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(n_layers))
            self.norm = dsnorm.RMSNorm(d)

        def forward(self, h):
            for block in self.layers:
                h = block(h)
            return self.norm(h)

    model = Model

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        save_file(gains, path)
        sharded = model()
        for block in sharded.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        replicated = model()
        for mod in replicated.modules():
            if isinstance(mod, dsnorm.RMSNorm):
                mod.weight = torch.nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Replicate()]))
        for m in (sharded, replicated):
            report = dsnorm.load_norms(m, path)
            assert len(report.loaded) == len(gains), report
            for name, p in m.named_parameters():
                _bitwise(p.full_tensor(), gains[name].float(), f"{name} loaded into {tuple(p.placements)}")
        # After a forward that left the root unsharded (its norm.weight a plain gathered tensor
        # that the next reshard drops): the load reaches the sharded parameters all the same.
        gathered = model()
        for block in gathered.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(gathered, mesh=mesh)
        with torch.no_grad():
            gathered(torch.ones(2, d))
        assert not isinstance(gathered.norm.weight, type(sharded.norm.weight)), "the root resharded by itself"
        dsnorm.load_norms(gathered, path)
        gathered.reshard()
        for name, p in gathered.named_parameters():
            _bitwise(p.full_tensor(), gains[name].float(), f"{name} loaded after an unsharding forward")
        # The norms' group owned by an FSDP2 root above the module passed (load_norms(lm.model)),
        # left gathered by a forward: resharded all the same, the values kept.
        class Outer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model()

            def forward(self, h):
                return self.model(h)

        outer = Outer()
        fully_shard(outer, mesh=mesh)
        with torch.no_grad():
            outer(torch.ones(2, d))
        dsnorm.load_norms(outer.model, path)
        outer.reshard()
        for name, p in outer.model.named_parameters():
            _bitwise(p.full_tensor(), gains[name].float(), f"{name} loaded through a submodule of the FSDP root")
        # A Partial parameter holds a pending sum: refused by name, nothing written.
        from torch.distributed.tensor import DTensor, Partial

        pending = model()
        w = pending.norm.weight
        pending.norm.weight = torch.nn.Parameter(DTensor.from_local(w.detach().clone(), mesh, [Partial()]))
        with pytest.raises(ValueError, match=r"norm: weight is a DTensor placed \(Partial\(sum\),\)"):
            dsnorm.load_norms(pending, path)
        _bitwise(pending.norm.weight.to_local(), torch.ones(d), "Partial weight untouched")


@check
def fsdp2(mesh):
    """fully_shard on Linear + RMSNorm: outputs bitwise per rank, gradients averaged over ranks."""
    import dsnorm
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    n, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 40), dsnorm.RMSNorm(40))
    with torch.no_grad():
        model[1].weight.copy_(1 + 0.5 * _randn((40,), torch.float32, 61))
    ref = copy.deepcopy(model)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model[1].weight, DTensor) and tuple(model[1].weight.placements) == (Shard(0),)

    xs = [_randn((3, 5, 32), torch.float32, 70 + i) for i in range(n)]
    gs = [_randn((3, 5, 40), torch.float32, 80 + i) for i in range(n)]
    y = model(xs[rank])
    y.backward(gs[rank])
    # reference: each rank's loss on the unsharded copy; FSDP averages the gradients over ranks
    ref_grads = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
    for i in range(n):
        ref.zero_grad()
        yi = ref(xs[i])
        if i == rank:
            _bitwise(y.detach(), yi.detach(), "FSDP2 y")
        yi.backward(gs[i])
        for name, p in ref.named_parameters():
            ref_grads[name] += p.grad / n
    for name, p in model.named_parameters():
        _rel_close(p.grad.full_tensor(), ref_grads[name], f"FSDP2 grad of {name}")


def _worker_main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import dsnorm.distributed  # registers the rules whether or not `import dsnorm` does it yet
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    results = {}
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed import tensor  # noqa: F401  (the import hook registers the rules now)

        results["registered"] = "ok" if dsnorm.distributed.is_registered() else "rules not registered"
        meshes = {f"ws{world}": init_device_mesh("cpu", (world,)), f"ws{SUB}": DeviceMesh("cpu", list(range(SUB)))}
        for name, fn in CHECKS.items():
            for mesh_name, mesh in meshes.items():
                key = f"{name}[{mesh_name}]"
                t0 = time.perf_counter()
                if mesh.get_coordinate() is None:
                    results[key] = "skipped"
                else:
                    try:
                        fn(mesh)
                        results[key] = "ok"
                    except BaseException:  # noqa: BLE001 (reported to the test)
                        results[key] = traceback.format_exc()
                print(f"rank {rank} {key} {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
                dist.barrier()  # keep the ranks in step: a failed check must not pair up collectives
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Test side

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("dtensor"))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    elif sys.platform == "darwin":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0")
    procs = []
    logs = []
    for rank in range(WORLD):
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), out_dir],
                                      env=dict(env, RANK=str(rank)), stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_rank = []
    for rank, log in enumerate(logs):
        log.seek(0)
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            pytest.fail(f"rank {rank} wrote no results (exit {procs[rank].returncode}):\n{log.read()[-4000:]}")
        with open(path) as f:
            per_rank.append(json.load(f))
    return per_rank


def _assert_ok(results, key, ranks):
    for rank in ranks:
        got = results[rank].get(key)
        assert got is not None, f"rank {rank} did not run {key}"
        assert got == "ok", f"rank {rank}, {key}:\n{got}"


@needs_gloo
def test_rules_registered(results):
    _assert_ok(results, "registered", range(WORLD))


@needs_gloo
@pytest.mark.parametrize("world", [SUB, WORLD])
@pytest.mark.parametrize("name", list(CHECKS))
def test_dtensor(results, name, world):
    _assert_ok(results, f"{name}[ws{world}]", range(world))
    for rank in range(world, WORLD):
        assert results[rank][f"{name}[ws{world}]"] == "skipped"


def _run_fresh_python(code: str, timeout: int = 120, hang: str = "timed out") -> None:
    """Run ``code`` in a new interpreter (nothing imported yet); it must exit 0 within ``timeout``."""
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(hang)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_import_registers_lazily():
    """dsnorm.distributed registers after torch.distributed.tensor's first import and imports nothing heavy."""
    code = (
        "import sys, torch, dsnorm.distributed as dd\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'imported eagerly'\n"
        "assert not dd.is_registered()\n"
        "import torch.distributed.tensor\n"
        "assert dd.is_registered(), 'not registered after import'\n"
        "from torch.distributed.tensor import DTensor\n"
        "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "assert torch.ops.dsnorm.rms_norm.default in funcs and torch.ops.dsnorm.fused_add_rms_norm_.default in funcs\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    _run_fresh_python(code)


# Kills: the import hook removed itself in find_spec: a probe (importlib.util.find_spec, which
# imports nothing) disarmed it, and the real import later registered no rules.
def test_a_find_spec_probe_does_not_disarm_the_registration():
    code = (
        "import importlib.util, sys, torch, dsnorm.distributed as dd\n"
        "assert importlib.util.find_spec('torch.distributed.tensor') is not None\n"
        "assert 'torch.distributed.tensor' not in sys.modules and not dd.is_registered()\n"
        "import torch.distributed.tensor\n"
        "assert dd.is_registered(), 'not registered after a probe, then the import'\n"
        "assert dd._finder not in sys.meta_path, 'the hook outlived the import'\n"
    )
    _run_fresh_python(code)


# Kills: two import hooks after importlib.reload (the old and the new finder called each other:
# RecursionError at the import).
def test_reload_before_the_import_still_registers():
    code = (
        "import importlib, sys, torch, dsnorm.distributed as dd\n"
        "importlib.reload(dd)\n"
        "import torch.distributed.tensor\n"
        "assert dd.is_registered()\n"
        "assert not [f for f in sys.meta_path if getattr(f, '_dsnorm_dtensor_hook', False)]\n"
    )
    _run_fresh_python(code)


# Kills: register() took its lock, then imported torch.distributed.tensor, while another thread's
# import of it (holding the module's import lock) waited in the hook for that lock: both hung.
def test_register_while_another_thread_imports_does_not_deadlock():
    code = (
        "import threading, time, torch, dsnorm.distributed as dd\n"
        "t = threading.Thread(target=lambda: __import__('torch.distributed.tensor'))\n"
        "t.start()\n"
        "time.sleep(0.05)  # the other thread is inside the module's execution (~0.5 s)\n"
        "dd.register()\n"
        "t.join()\n"
        "assert dd.is_registered()\n"
    )
    _run_fresh_python(code, timeout=60, hang="register() and an import of torch.distributed.tensor in another thread deadlocked")


# Kills: install() (public, and run again by importlib.reload) called register() under its lock
# while another thread's import, in the hook, waited for that lock.
def test_install_while_another_thread_imports_does_not_deadlock():
    code = (
        "import threading, time, torch, dsnorm.distributed as dd\n"
        "t = threading.Thread(target=lambda: __import__('torch.distributed.tensor'))\n"
        "t.start()\n"
        "time.sleep(0.05)\n"
        "dd.install()\n"
        "t.join()\n"
        "assert dd.is_registered()\n"
    )
    _run_fresh_python(code, timeout=60, hang="install() and an import of torch.distributed.tensor in another thread deadlocked")


if __name__ == "__main__":
    _worker_main(sys.argv[1])
