"""The allocating forms' outputs: ordinary tensors whatever memory they come from.

Outputs of 4 MiB or more come from dsnorm's own huge-page-aligned blocks, and a block whose tensor
has been freed is kept for the next output of its size (at most 4 blocks and 512 MiB, released by
``dsnorm.empty_cache()``). These tests hold the contract a user sees: values equal to the reference,
memory never handed out twice while anything (a view, the storage, numpy) still refers to it,
inference tensors under ``torch.inference_mode``, and the bound.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import dsnorm
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref

SHAPE = (2, 1100, 1024)  # 4.3 MiB in bf16: a pooled output, not a whole number of huge pages


def _inputs(seed, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    r = (4 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(shape[-1], generator=gen)
    return x, r, w


@pytest.fixture(autouse=True)
def _empty_pool():
    dsnorm.empty_cache()
    yield
    dsnorm.empty_cache()


def test_freed_output_memory_is_reused_with_fresh_values():
    x, r, w = _inputs(1)
    y = dsnorm.rms_norm(x, w)
    address = y.data_ptr()
    del y
    x2, _, _ = _inputs(2)
    y2 = dsnorm.rms_norm(x2, w)
    assert y2.data_ptr() == address  # the freed block, not a fresh mapping
    assert torch.equal(y2, rms_norm_ref(x2, w))
    y3, r3 = dsnorm.fused_add_rms_norm(x, r, w)
    assert {y3.data_ptr(), r3.data_ptr()}.isdisjoint({y2.data_ptr()})
    assert all(map(torch.equal, (y3, r3), fused_add_rms_norm_ref(x, r, w)))


@pytest.mark.parametrize("holder", ["view", "storage", "numpy", "tensor"])
def test_memory_is_not_reused_while_anything_refers_to_it(holder):
    x, _, w = _inputs(3)
    y = dsnorm.rms_norm(x, w)
    kept = {"view": lambda: y[1, 5:], "storage": lambda: y.untyped_storage(),
            "numpy": lambda: y.view(torch.int16).numpy(), "tensor": lambda: y}[holder]()
    before = y.clone()
    span = (y.data_ptr(), y.data_ptr() + y.nbytes)
    del y
    for seed in (4, 5, 6):  # more calls than the pool holds blocks
        other = dsnorm.rms_norm(_inputs(seed)[0], w)
        assert not span[0] <= other.data_ptr() < span[1]
        del other
    if holder == "storage":
        kept = torch.empty(0, dtype=torch.bfloat16).set_(kept, 0, SHAPE)
        assert torch.equal(kept, before)
    elif holder == "numpy":
        assert torch.equal(torch.from_numpy(kept).view(torch.bfloat16), before)
    elif holder == "view":
        assert torch.equal(kept, before[1, 5:])
    else:
        assert torch.equal(kept, before)


def test_pool_is_bounded_and_empty_cache_releases_it():
    x, _, w = _inputs(7)
    outs = [dsnorm.rms_norm(x, w) for _ in range(6)]
    del outs  # six freed blocks of one size: the pool keeps four
    one = dsnorm.empty_cache()
    assert one > 0
    outs = [dsnorm.rms_norm(x, w)]
    del outs
    assert dsnorm.empty_cache() * 4 == one  # a block is a quarter of what four were
    assert dsnorm.empty_cache() == 0


def test_outputs_in_inference_mode_are_inference_tensors():
    x, r, w = _inputs(8)
    with torch.inference_mode():
        y, s = dsnorm.fused_add_rms_norm(x, r, w)
        assert y.is_inference() and s.is_inference()
        addresses = {y.data_ptr(), s.data_ptr()}
    del y, s  # the blocks go back to the pool, and come out of it as normal tensors
    y = dsnorm.rms_norm(x, w)
    assert y.data_ptr() in addresses and not y.is_inference()
    y.requires_grad_()
    (y.float() * 2).sum().backward()  # an ordinary autograd leaf
    assert torch.equal(y.grad, torch.full_like(y, 2))
    version = y._version
    with torch.no_grad():
        y.add_(1)  # in-place writes are counted, as autograd needs
    assert y._version == version + 1


def test_outputs_freed_on_another_thread():
    x, r, w = _inputs(9)
    outs = list(dsnorm.fused_add_rms_norm(x, r, w))
    addresses = {t.data_ptr() for t in outs}
    t = threading.Thread(target=outs.clear)
    t.start()
    t.join()
    y, s = dsnorm.fused_add_rms_norm(x, r, w)
    assert {y.data_ptr(), s.data_ptr()} == addresses
    assert all(map(torch.equal, (y, s), fused_add_rms_norm_ref(x, r, w)))


def test_gradients_come_from_the_pool_too():
    x, r, w = _inputs(10)
    x.requires_grad_()
    dsnorm.rms_norm(x, w).float().sum().backward()
    g = x.grad.clone()
    address = x.grad.data_ptr()
    x.grad = None  # the freed gradient is reused by the next output of its size
    y = dsnorm.rms_norm(x.detach(), w)
    assert y.data_ptr() == address
    x.grad = None
    dsnorm.rms_norm(x, w).float().sum().backward()
    assert torch.equal(x.grad, g)


def test_an_output_freed_while_the_pool_is_busy():
    # The cyclic GC may run inside any allocation, the pool's own included, and free an output
    # whose block then comes back while this thread holds the pool: neither a deadlock nor a lost
    # block. Freeing an output with the pool's lock held is that moment, made deterministic (the
    # one internal this file reads).
    script = textwrap.dedent("""
        import torch, dsnorm
        from dsnorm.cpu import alloc
        x = torch.randn(2, 1100, 1024).to(torch.bfloat16)
        w = torch.ones(1024)
        y = dsnorm.rms_norm(x, w)
        address = y.data_ptr()
        with alloc._POOL._lock:
            del y
        z = dsnorm.rms_norm(x, w)
        assert z.data_ptr() == address, "the block was lost"
        assert torch.equal(z, dsnorm.rms_norm_ref(x, w))
        print("ok")
    """)
    try:
        # The kernels are compiled before the lock is taken: a hang after that is the pool's.
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("no answer in 600 s: freeing an output while the pool's lock was held deadlocks")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
