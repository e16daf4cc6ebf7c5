"""Tensors that are torch.Tensor by type but not plain memory: lazily negated views (the
negative bit), ZeroTensors (no memory at all), and non-strided layouts. The fast lane and the
direct op calls read raw pointers, so each of these must either take the dispatcher (which
resolves them) or be refused by name; none may be read as if it were plain memory."""

import warnings

import pytest
import torch

import dsnorm
from dsnorm.ref import fused_add_rms_norm_ref, rms_norm_ref

from conftest import bits_equal


def _data(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _weight(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) + 0.5


def _negated(t):
    """A view with the negative bit set whose values are -t (the bits of t stay in memory)."""
    v = torch._neg_view(t)
    assert v.is_neg()
    return v


GRAD_MODES = (pytest.param(False, id="no_grad"), pytest.param(True, id="grad"))


@pytest.mark.parametrize("grad", GRAD_MODES)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 111), (64, 1, 512)])
def test_negative_bit_inputs_are_read_negated(grad, shape):
    n = shape[-1]
    x, r, w = _data(shape, 1), _data(shape, 2), _weight(n)
    with torch.set_grad_enabled(grad):
        assert bits_equal(dsnorm.rms_norm(_negated(x), w), rms_norm_ref(-x, w))
        assert bits_equal(dsnorm.RMSNorm(n)(_negated(x)), rms_norm_ref(-x, torch.ones(n)))
        assert bits_equal(dsnorm.rms_norm(x, _negated(w)), rms_norm_ref(x, -w))
        for a, b in ((_negated(x), r), (x, _negated(r))):
            y, res = dsnorm.fused_add_rms_norm(a, b, w)
            y_ref, res_ref = fused_add_rms_norm_ref(a.resolve_neg(), b.resolve_neg(), w)
            assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


def test_negative_bit_gradients():
    x = _data((4, 96), 3, torch.float32).requires_grad_()
    w = _weight(96).requires_grad_()
    dsnorm.rms_norm(_negated(x), w).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    rms_norm_ref(-x2, w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["x", "residual"])
def test_in_place_refuses_a_negated_view_by_name(name):
    x, r, w = _data((2, 64), 1), _data((2, 64), 2), _weight(64)
    tensors = {"x": x.clone(), "residual": r.clone()}
    tensors[name] = _negated(tensors[name])
    before = {k: v.resolve_neg().clone() for k, v in tensors.items()}
    with torch.no_grad(), pytest.raises(ValueError, match=f"^{name} is a lazily negated view"):
        dsnorm.fused_add_rms_norm_(tensors["x"], tensors["residual"], w)
    for k, v in tensors.items():
        assert bits_equal(v.resolve_neg(), before[k])


@pytest.mark.parametrize("grad", GRAD_MODES)
def test_zero_tensors_are_zeros(grad):
    # A ZeroTensor has no memory (data_ptr() is 0): read directly it would crash the process.
    x, w = _data((3, 1, 1536), 1), _weight(1536)
    zeros = torch.zeros(3, 1, 1536, dtype=torch.bfloat16)
    with torch.set_grad_enabled(grad):
        z = torch._efficientzerotensor(3, 1, 1536, dtype=torch.bfloat16)
        assert z.data_ptr() == 0
        assert bits_equal(dsnorm.rms_norm(z, w), rms_norm_ref(zeros, w))
        assert bits_equal(dsnorm.RMSNorm(1536)(z), zeros)
        y, res = dsnorm.fused_add_rms_norm(x, z, w)
        y_ref, res_ref = fused_add_rms_norm_ref(x, zeros, w)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
        y, res = dsnorm.RMSNorm(1536)(z, x)
        y_ref, res_ref = fused_add_rms_norm_ref(zeros, x, torch.ones(1536))
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
        assert bits_equal(dsnorm.rms_norm(x, torch._efficientzerotensor(1536)), rms_norm_ref(x, torch.zeros(1536)))
        # A slice of one keeps the ZeroTensor key but gets a made-up nonzero address.
        sliced = torch._efficientzerotensor(4, 1, 1536, dtype=torch.bfloat16)[1:]
        assert sliced._is_zerotensor() and sliced.data_ptr() != 0
        assert bits_equal(dsnorm.rms_norm(sliced, w), rms_norm_ref(zeros, w))
        w_sliced = torch._efficientzerotensor(3072)[1536:]
        assert bits_equal(dsnorm.rms_norm(x, w_sliced), rms_norm_ref(x, torch.zeros(1536)))
        y, res = dsnorm.fused_add_rms_norm(x, sliced, w)
        y_ref, res_ref = fused_add_rms_norm_ref(x, zeros, w)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
    if not grad:
        xi = x.clone()
        with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):  # torch's own refusal
            dsnorm.fused_add_rms_norm_(xi, sliced, w)
        assert bits_equal(xi, x)


def test_zero_tensor_weight_keeps_its_gradient():
    x = _data((3, 64), 8, torch.float32).requires_grad_()
    w = torch._efficientzerotensor(64, requires_grad=True)
    y = dsnorm.rms_norm(x, w)
    assert y.requires_grad
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    w2 = torch.zeros(64, requires_grad=True)
    rms_norm_ref(x2, w2).sum().backward()
    assert bits_equal(w.grad, w2.grad) and bits_equal(x.grad, x2.grad)


def _nested():
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(2, 16), torch.randn(3, 16)])


KINDS = {
    "sparse_coo": (lambda: torch.randn(4, 16).to_sparse(), "layout torch.sparse_coo"),
    "sparse_csr": (lambda: torch.randn(4, 16).to_sparse_csr(), "layout torch.sparse_csr"),
    "mkldnn": (lambda: torch.randn(4, 16).to_mkldnn(), "layout torch._mkldnn"),
    "nested": (_nested, "a nested tensor"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_non_strided_inputs_are_refused_by_name(kind):
    make, what = KINDS[kind]
    w = torch.rand(16)
    dense = torch.randn(4, 16)
    message = f"must be a dense \\(torch.strided\\) tensor, got {what}"
    with pytest.raises(TypeError, match="^x " + message):
        dsnorm.rms_norm(make(), w)
    with pytest.raises(TypeError, match="^x " + message):
        dsnorm.RMSNorm(16)(make())
    with pytest.raises(TypeError, match="^x " + message):
        dsnorm.fused_add_rms_norm(make(), dense, w)
    if kind != "nested":  # a nested weight or residual has no [n] / [4, 16] shape to compare
        with pytest.raises(TypeError, match="^residual " + message):
            dsnorm.fused_add_rms_norm(dense, make(), w)
    if kind in ("sparse_coo", "mkldnn"):  # 1-D forms of these exist
        weight = torch.rand(16).to_sparse() if kind == "sparse_coo" else torch.rand(16).to_mkldnn()
        with pytest.raises(TypeError, match="^weight " + message):
            dsnorm.rms_norm(dense, weight)


def test_fusions_read_negated_and_zero_inputs():
    # The fusions share the direct-call gate (autograd._direct) with the core functions.
    x, r, w = _data((2, 1, 256), 1), _data((2, 1, 256), 2), _weight(256)
    zero = torch._efficientzerotensor(2, 1, 256, dtype=torch.bfloat16)
    for a, b in ((_negated(x), r), (x, _negated(r)), (x, zero)):
        plain_a, plain_b = a.resolve_neg().clone(), b.resolve_neg().clone()
        for got, want in (
            (dsnorm.rms_norm_fp8(a, w), dsnorm.rms_norm_fp8(plain_a, w)),
            (dsnorm.fused_add_rms_norm_fp8(a, b, w), dsnorm.fused_add_rms_norm_fp8(plain_a, plain_b, w)),
            (dsnorm.final_norm(a, b, w), dsnorm.final_norm(plain_a, plain_b, w)),
        ):
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            assert len(got) == len(want) and all(bits_equal(g, h) for g, h in zip(got, want))
    q, kv = _data((2, 1, 1536), 3), _data((2, 1, 576), 4)
    wq, wkv = _weight(1536), _weight(512)
    want = dsnorm.mla_latent_norms(-q, kv, wq, wkv)
    got = dsnorm.mla_latent_norms(_negated(q), kv, wq, wkv)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])


@pytest.mark.parametrize("fused", [False, True])
def test_backward_reads_a_negated_or_zero_output_gradient(fused):
    x0, r0, w0 = _data((3, 64), 5, torch.float32), _data((3, 64), 6, torch.float32), _weight(64)
    g = _data((3, 64), 7, torch.float32)

    def grads(dy):
        x, r, w = (t.clone().requires_grad_() for t in (x0, r0, w0))
        y = dsnorm.fused_add_rms_norm(x, r, w)[0] if fused else dsnorm.rms_norm(x, w)
        y.backward(dy)
        return x.grad, w.grad

    for dy, plain in ((_negated(g), -g), (torch._efficientzerotensor(3, 64), torch.zeros(3, 64))):
        for got, want in zip(grads(dy), grads(plain)):
            assert bits_equal(got, want)


def test_mla_pair_reads_negated_and_zero_inputs():
    # The MLA pair's own lane (dsnorm.cpu.lane.mla_lane) refuses what it cannot read as raw memory.
    q, kv = _data((2, 1, 1536), 8), _data((2, 1, 576), 9)
    wq, wkv = _weight(1536), _weight(512)
    zero_kv = torch._efficientzerotensor(2, 1, 576, dtype=torch.bfloat16)
    for args in ((q, _negated(kv), wq, wkv), (q, zero_kv, wq, wkv), (q, kv, _negated(wq), wkv),
                 (q, kv, wq, torch._efficientzerotensor(512))):
        plain = tuple(t.resolve_neg().clone() if t.is_neg() else (torch.zeros_like(t) if t._is_zerotensor() else t)
                      for t in args)
        got, want = dsnorm.mla_latent_norms(*args), dsnorm.mla_latent_norms(*plain)
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
