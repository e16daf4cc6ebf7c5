"""Backward on CPU: gradcheck of dsnorm's own kernels in fp64, fp32 against fp64, determinism."""

import pytest
import torch

import dsnorm
from dsnorm.ref import RMSNormRef, fused_add_rms_norm_ref, rms_norm_backward_ref, rms_norm_ref

from conftest import assert_grad_close, assert_y_close, bits_equal, count_lane_calls, max_ulp


def _rand(shape, dtype=torch.float64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("width", [1, 7, 111, 512])
def test_gradcheck_plain(width):
    x = _rand((3, width), seed=1).requires_grad_()
    w = _rand((width,), seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: dsnorm.rms_norm(a, b), (x, w))


@pytest.mark.parametrize("rounding", ["fp32_sum", "round_first"])
@pytest.mark.parametrize("use", ["y", "residual", "both"])
def test_gradcheck_fused(rounding, use):
    x = _rand((2, 3, 33), seed=3).requires_grad_()
    r = _rand((2, 3, 33), seed=4).requires_grad_()
    w = _rand((33,), seed=5).requires_grad_()

    def f(a, b, c):
        y, res = dsnorm.fused_add_rms_norm(a, b, c, residual_rounding=rounding)
        return {"y": (y,), "residual": (res,), "both": (y, res)}[use]

    assert torch.autograd.gradcheck(f, (x, r, w))


def test_gradcheck_strided_input():
    base = _rand((4, 40), seed=6)
    x = base[:, :33].clone().requires_grad_()
    w = _rand((33,), seed=7).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: dsnorm.rms_norm(a[::2], b), (x, w))


def _normwise(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(64, 7168), (4, 1536), (17, 769)])
def test_fp32_gradients_match_fp64(shape):
    x, r, w = _rand(shape, torch.float32, 8), _rand(shape, torch.float32, 9), _rand(shape[-1:], torch.float32, 10)
    dy, dres_out = _rand(shape, torch.float32, 11), _rand(shape, torch.float32, 12)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, res = dsnorm.fused_add_rms_norm(xs, rs, ws)
    torch.autograd.backward((y, res), (dy, dres_out))
    ds_ref, dw_ref = rms_norm_backward_ref(dy, x.double() + r.double(), w)
    ds_ref = ds_ref + dres_out.double()
    assert _normwise(xs.grad, ds_ref) < 1e-5
    assert _normwise(rs.grad, ds_ref) < 1e-5
    assert _normwise(ws.grad, dw_ref) < 1e-5


def test_bf16_gradients_dtypes_and_values():
    x, r = _rand((8, 512), torch.bfloat16, 13), _rand((8, 512), torch.bfloat16, 14)
    w = _rand((512,), torch.float32, 15)
    xs, rs, ws = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    y, res = dsnorm.fused_add_rms_norm(xs, rs, ws)
    dy = _rand((8, 512), torch.bfloat16, 16)
    y.backward(dy)
    assert xs.grad.dtype == rs.grad.dtype == torch.bfloat16 and ws.grad.dtype == torch.float32
    s = x.double() + r.double()
    ds_ref, dw_ref = rms_norm_backward_ref(dy, s, w)
    # Half a bf16 ulp of fp64 autograd, elementwise, plus fp32 error relative to the summed terms
    # (a 0.8% scaling of the gradient passed the 1e-2 tolerance this replaced).
    term = float((dy.double() * w.double() * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).abs().max())
    assert_grad_close(xs.grad, ds_ref, term)
    assert_grad_close(rs.grad, ds_ref, term)
    assert _normwise(ws.grad, dw_ref) < 1e-5


def test_fp32_residual_stream_gradient_dtype():
    x = _rand((4, 64), torch.bfloat16, 17).requires_grad_()
    r = _rand((4, 64), torch.float32, 18).requires_grad_()
    y, res = dsnorm.fused_add_rms_norm(x, r, torch.ones(64), residual_dtype=torch.float32)
    (y.float().sum() + res.sum()).backward()
    assert x.grad.dtype == torch.bfloat16 and r.grad.dtype == torch.float32


def test_residual_gradient_written_once_only_along_a_chain_of_fused_norms():
    # The gradient of x + residual is one tensor for both inputs. Where the residual is another
    # fused norm's residual_out (a chain of blocks) it is written once and handed to both: that
    # norm's backward only reads it. The gradients reaching the leaves are the same bits as when
    # both are written.
    a, b, c = (_rand((5, 96), torch.bfloat16, s) for s in (60, 61, 62))
    w = _rand((96,), torch.float32, 63)
    dy, dro = _rand((5, 96), torch.bfloat16, 64), _rand((5, 96), torch.bfloat16, 65)

    def chain(link):
        xs = [t.clone().requires_grad_() for t in (a, b, c)]
        y1, r1 = dsnorm.fused_add_rms_norm(xs[0], xs[1], w)
        y2, r2 = dsnorm.fused_add_rms_norm(xs[2], link(r1), w)
        torch.autograd.backward((y1, y2, r2), (dy, dy, dro))
        return [t.grad for t in xs]

    shared = chain(lambda r1: r1)
    apart = chain(lambda r1: r1.clone())  # a residual made by another op: both written
    assert all(bits_equal(g, h) for g, h in zip(shared, apart))
    y1, r1 = dsnorm.fused_add_rms_norm(a.clone().requires_grad_(), b.clone().requires_grad_(), w)
    cs = c.clone().requires_grad_()
    y2, r2 = dsnorm.fused_add_rms_norm(cs, r1, w)
    gc, gr1 = torch.autograd.grad((y2, r2), (cs, r1), (dy, dro))
    assert gc is gr1
    # Against the reference's graph: s = c + r1, the same gradient within an ulp.
    ce, re_ = c.clone().requires_grad_(), r1.detach().clone().requires_grad_()
    s = ce.float() + re_.float()
    want, = torch.autograd.grad((rms_norm_ref(s, w).to(c.dtype), s.to(c.dtype)), (ce,), (dy, dro))
    assert max_ulp(gc, want) <= 1


def test_leaves_get_gradients_of_their_own():
    # Leaves, directly or through views (the storage a view of one gradient would share between
    # two .grad tensors survives in-place updates: pytorch#34082), get two gradient tensors:
    # accumulation over two passes doubles each, and zeroing one leaves the other.
    n = 64
    x0, r0 = _rand((6, n), torch.float32, 66), _rand((6, n), torch.float32, 67)
    w = torch.linspace(0.5, 1.5, n)
    for view in (lambda t: t, lambda t: t.view(2, 3, n)):
        x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()

        def step():
            y, ro = dsnorm.fused_add_rms_norm(view(x), view(r), w)
            (y.sum() + (ro * ro).sum()).backward()

        step()
        once_x, once_r = x.grad.clone(), r.grad.clone()
        assert bits_equal(once_x, once_r)
        assert x.grad.untyped_storage().data_ptr() != r.grad.untyped_storage().data_ptr()
        step()
        assert bits_equal(x.grad, 2 * once_x) and bits_equal(r.grad, 2 * once_r)
        x.grad.zero_()
        assert bits_equal(r.grad, 2 * once_r)
        gx, gr = torch.autograd.grad(dsnorm.fused_add_rms_norm(view(x), view(r), w)[1].sum(), (x, r))
        assert gx is not gr and bits_equal(gx, gr)


def test_saved_tensor_hooks_are_checked_not_trusted():
    # An unpack hook may hand back other tensors than the forward saved (PyTorch asks for the same
    # content, nothing enforces it): with saved-tensor hooks active the backward checks them, so
    # a wrong dtype or shape is refused by name instead of being read as raw memory; hooks that
    # keep their contract (torch.utils.checkpoint, save_on_cpu) give the usual gradients.
    x = _rand((4, 64), torch.bfloat16, 68).requires_grad_()
    r = _rand((4, 64), torch.bfloat16, 69).requires_grad_()
    w = torch.rand(64) + 0.5

    def grads(unpack, fused):
        x.grad = r.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = dsnorm.fused_add_rms_norm(x, r, w)[0] if fused else dsnorm.rms_norm(x, w)
        y.backward(torch.ones_like(y))
        return x.grad

    for fused in (False, True):
        want = grads(lambda t: t, fused)
        with torch.autograd.graph.save_on_cpu():
            y = dsnorm.fused_add_rms_norm(x, r, w)[0] if fused else dsnorm.rms_norm(x, w)
        x.grad = None
        y.backward(torch.ones_like(y))
        assert bits_equal(x.grad, want)
        with pytest.raises(TypeError, match="must be"):
            grads(lambda t: t.float(), fused)
        with pytest.raises(ValueError, match="must have shape"):
            grads(lambda t: t.reshape(-1) if t.dim() == 2 else t, fused)


def test_saved_tensors_swapped_after_the_forward_are_refused_by_name():
    # After the forward, a saved input can become another tensor without a version bump (.data
    # reassigned) or through a hook on one saved tensor: refused by name before any kernel reads
    # or writes it (the unchecked call wrote a dresidual sized from the swapped residual).
    w = torch.rand(64) + 0.5
    x0, r0, c0 = (_rand((4, 64), torch.float32, s) for s in (75, 76, 77))
    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    y, _ = dsnorm.fused_add_rms_norm(x, r, w)
    r.data = torch.full((4, 8), 1e30)
    with pytest.raises(ValueError, match="residual must have"):
        torch.autograd.grad(y, (x, r), torch.ones_like(y))
    # along a chain (the residual's gradient shared): a saved residual of fewer rows
    a, b, c = x0.clone().requires_grad_(), r0.clone().requires_grad_(), c0.clone().requires_grad_()
    _, r1 = dsnorm.fused_add_rms_norm(a, b, w)
    y2, _ = dsnorm.fused_add_rms_norm(c, r1, w)
    y2.grad_fn._raw_saved_tensors[1].register_hooks(lambda t: None, lambda _: torch.ones(2, 64))
    with pytest.raises(ValueError, match="residual must have"):
        torch.autograd.grad(y2, (c,), torch.ones_like(y2))
    # the plain form: a saved weight cut short, or expanded from one element (read with unit stride)
    for swapped, error in ((torch.ones(8), "weight must have shape"), (torch.ones(1).expand(64), "weight")):
        x = x0.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y = dsnorm.rms_norm(x, wg)
        wg.data = swapped
        with pytest.raises(ValueError, match=error):
            torch.autograd.grad(y, (x,), torch.ones_like(y))
    # no gradient for y: the residual_out gradient is x's and the residual's as it is, and the saved
    # tensors (here handed back by a hook with more rows) are not read for it
    def more_rows(t):
        return t.repeat(4, 1) if t.dim() == 2 else (t.repeat(4) if t.shape == (4,) else t)

    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, more_rows):
        _, ro = dsnorm.fused_add_rms_norm(x, r, w)
    dro = _rand((4, 64), torch.float32, 78)
    dx, dr = torch.autograd.grad(ro, (x, r), dro)
    assert bits_equal(dx, dro) and bits_equal(dr, dro)
    # with a gradient for y, a residual_out gradient of other rows than the saved x's is refused
    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, more_rows):
        y, ro = dsnorm.fused_add_rms_norm(x, r, w)
    with pytest.raises(ValueError, match="must have"):
        torch.autograd.grad((y, ro), (x, r), (torch.ones_like(y), torch.ones_like(ro)))


def test_low_precision_weight_gradient_comes_back_in_its_dtype():
    x = _rand((4, 64), torch.float32, 19)
    w = _rand((64,), torch.bfloat16, 20).requires_grad_()
    dsnorm.rms_norm(x, w).sum().backward()
    assert w.grad.dtype == torch.bfloat16


def test_dweight_deterministic_across_runs_and_threads(threads):
    x, w = _rand((1000, 1536), torch.float32, 21), _rand((1536,), torch.float32, 22)
    dy = _rand((1000, 1536), torch.float32, 23)
    grads = []
    for nthreads in (2, 1, 2):
        torch.set_num_threads(nthreads)
        ws = w.clone().requires_grad_()
        xs = x.clone().requires_grad_()
        dsnorm.rms_norm(xs, ws).backward(dy)
        grads.append((xs.grad, ws.grad))
    for dx, dw in grads[1:]:
        assert bits_equal(dx, grads[0][0]) and bits_equal(dw, grads[0][1])


def test_module_training_step():
    # One SGD step through the module: forward values against the reference, every gradient against
    # fp64 autograd of the reference formula, and the step itself.
    torch.manual_seed(0)
    m = dsnorm.RMSNorm(256)
    with torch.no_grad():
        m.weight.copy_(torch.rand(256) + 0.5)  # a gain that is not all ones: its gradient is seen
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x0, r0 = torch.randn(4, 3, 256), torch.randn(4, 3, 256)
    x, r = x0.clone().requires_grad_(), r0.clone().requires_grad_()
    y, res = m(x, r)
    y_ref, res_ref = fused_add_rms_norm_ref(x0, r0, m.weight.detach())
    assert_y_close(y.detach(), y_ref, 256)
    assert bits_equal(res.detach(), res_ref)
    (y.square().mean() + res.mean()).backward()
    dy = 2 * y.detach().double() / y.numel()
    ds_ref, dw_ref = rms_norm_backward_ref(dy, x0.double() + r0.double(), m.weight.detach())
    ds_ref = ds_ref + 1.0 / res.numel()
    assert _normwise(x.grad, ds_ref) < 1e-5 and _normwise(r.grad, ds_ref) < 1e-5
    assert _normwise(m.weight.grad, dw_ref) < 1e-5
    before, grad = m.weight.detach().clone(), m.weight.grad.clone()
    opt.step()
    assert bits_equal(m.weight.detach(), before.add(grad, alpha=-0.1))  # torch.optim.SGD's update


def test_inplace_form_refuses_grad():
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no gradient, but x requires grad"):
        dsnorm.fused_add_rms_norm_(x, torch.randn(2, 8), torch.ones(8))
    # The module's parameter is the usual way in: the message names the weight (a bf16 one widened).
    for w in (torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))):
        x = torch.randn(2, 8, dtype=w.dtype)
        with pytest.raises(RuntimeError, match="no gradient, but weight requires grad"):
            dsnorm.fused_add_rms_norm_(x, torch.randn(2, 8, dtype=w.dtype), w)


def test_training_calls_the_ops_only_when_observed(monkeypatch):
    # Plain eager training runs the ops' implementations directly (no dispatcher round trip); under
    # a dispatch mode the Functions' forward and backward go through torch.ops, where it sees them.
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsnorm import autograd

    def step():
        x = _rand((3, 64), torch.bfloat16).requires_grad_(True)
        r = _rand((3, 64), torch.bfloat16, seed=1).requires_grad_(True)
        w = torch.ones(64, requires_grad=True)
        y, s = dsnorm.fused_add_rms_norm(x, r, w)
        (y.float().sum() + s.float().sum()).backward()
        y = dsnorm.rms_norm(x, w)
        y.float().sum().backward()
        return x.grad, r.grad, w.grad

    want = step()
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        got = step()
    for name in ("fused_add_rms_norm_fwd", "fused_add_rms_norm_bwd", "rms_norm_fwd", "rms_norm_bwd"):
        assert f"dsnorm.{name}.default" in seen, name
    for a, b in zip(got, want):
        assert bits_equal(a, b)

    def refuse(*args, **kwargs):
        raise AssertionError("the dispatcher was used in plain eager training")

    for name in ("_fwd", "_bwd", "_fused_fwd", "_fused_bwd"):
        monkeypatch.setattr(autograd, name, refuse)
    for a, b in zip(step(), want):
        assert bits_equal(a, b)


def test_meta_tensors_take_the_op():
    # Meta tensors (model skeletons built under torch.device("meta")) are shaped by the ops' fakes,
    # in training too.
    with torch.device("meta"):
        norm = dsnorm.RMSNorm(64)
        x = torch.randn(2, 3, 64, requires_grad=True)
        y = norm(x)
        y2, s = norm(x, torch.randn(2, 3, 64))
    assert y.shape == y2.shape == s.shape == (2, 3, 64) and y.is_meta and s.is_meta
    y.sum().backward()
    assert x.grad.is_meta and norm.weight.grad.shape == (64,)


def test_profiler_sees_the_ops():
    x = _rand((3, 64), torch.bfloat16).requires_grad_(True)
    r = _rand((3, 64), torch.bfloat16, seed=1).requires_grad_(True)
    w = torch.ones(64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y, s = dsnorm.fused_add_rms_norm(x, r, w)
        (y.float().sum() + s.float().sum()).backward()
        with torch.no_grad():
            dsnorm.rms_norm(x, w)
    names = {e.name for e in prof.events()}
    for name in ("dsnorm::fused_add_rms_norm_fwd", "dsnorm::fused_add_rms_norm_bwd", "dsnorm::rms_norm"):
        assert name in names, name


def test_double_backward_is_refused_by_name():
    # The kernels' backward is not differentiable: create_graph=True (torch.func.grad's mode) gives
    # the first-order gradients, and a second derivative through them a clear error rather than a
    # second-order term that is wrong or silently dropped.
    x = _rand((3, 64)).requires_grad_(True)
    r = _rand((3, 64), seed=1).requires_grad_(True)
    w = torch.ones(64, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(dsnorm.rms_norm(x, w).pow(2).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(dsnorm.rms_norm(x, w).pow(2).sum(), x)
    assert torch.equal(gx, want)
    with pytest.raises(RuntimeError, match="dsnorm.rms_norm has no second derivative"):
        gx.sum().backward()
    gx, gr = torch.autograd.grad(dsnorm.fused_add_rms_norm(x, r, w)[0].pow(2).sum(), (x, r), create_graph=True)
    with pytest.raises(RuntimeError, match="dsnorm.fused_add_rms_norm has no second derivative"):
        gr.sum().backward()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # functorch loops over the batch for custom ops
def test_torch_func_transforms():
    # vmap (through the ops), grad and jacrev of the functions and of the module (whose weight is a
    # Parameter, so the autograd Function is always in the path).
    from torch.func import functional_call, grad, jacrev, vmap

    x, r = _rand((4, 3, 32), seed=40), _rand((4, 3, 32), seed=41)
    m = dsnorm.RMSNorm(32)
    with torch.no_grad():
        m.weight.copy_(torch.rand(32, dtype=torch.float64) + 0.5)
    ref = dsnorm.RMSNormRef(32).double()
    ref.load_state_dict(m.state_dict())
    assert torch.equal(vmap(m)(x), m(x).detach())
    y, res = vmap(m)(x, r)
    assert torch.equal(y, m(x, r)[0].detach()) and torch.equal(res, m(x, r)[1].detach())
    params = {"weight": m.weight.detach()}
    loss = lambda p, t: functional_call(m, p, (t,)).pow(2).sum()  # noqa: E731
    loss_ref = lambda p, t: functional_call(ref, p, (t,)).pow(2).sum()  # noqa: E731
    got, want = grad(loss)(params, x[0]), grad(loss_ref)(params, x[0])
    torch.testing.assert_close(got["weight"], want["weight"].float(), rtol=1e-6, atol=0)  # fp32 gain: fp32 grad
    # jacrev (vmap over vjp) against torch.autograd.functional's row-by-row Jacobian of the same fp64 norm
    norm = lambda t: dsnorm.rms_norm(t, m.weight.detach())  # noqa: E731
    assert torch.equal(jacrev(norm)(x[0, 0]), torch.autograd.functional.jacobian(norm, x[0, 0]))
    # the fused form: jacrev in both inputs, and per-sample gradients (vmap of grad)
    w = m.weight.detach()
    fused = lambda a, b: dsnorm.fused_add_rms_norm(a, b, w)  # noqa: E731
    for out in (0, 1):
        got = jacrev(lambda a, b: fused(a, b)[out], argnums=(0, 1))(x[0, 0], r[0, 0])
        want = torch.autograd.functional.jacobian(lambda a, b: fused(a, b)[out], (x[0, 0], r[0, 0]))
        assert all(torch.equal(g, h) for g, h in zip(got, want))
    fused_loss = lambda a, b: fused(a, b)[0].pow(2).sum() + fused(a, b)[1].sum()  # noqa: E731
    per_sample = vmap(grad(fused_loss, argnums=(0, 1)))(x, r)
    for i in range(x.shape[0]):
        xi, ri = x[i].clone().requires_grad_(), r[i].clone().requires_grad_()
        for g, h in zip(per_sample, torch.autograd.grad(fused_loss(xi, ri), (xi, ri))):
            torch.testing.assert_close(g[i], h, rtol=1e-12, atol=1e-12)


def test_batched_output_gradients():
    # torch.autograd.grad(..., is_grads_batched=True), which jacobian(vectorize=True) uses, hands
    # the backward storage-less batched gradients: they take the op (its batching fallback), not
    # the kernels ("Cannot access data pointer" before).
    x, r = _rand((3, 16), seed=42), _rand((3, 16), seed=43)
    w = _rand((16,), seed=44).abs() + 0.5
    jac = torch.autograd.functional.jacobian
    plain = lambda a: dsnorm.rms_norm(a, w)  # noqa: E731
    assert torch.equal(jac(plain, x, vectorize=True), jac(plain, x))
    fused = lambda a, b: dsnorm.fused_add_rms_norm(a, b, w)  # noqa: E731
    for got, want in zip(jac(fused, (x, r), vectorize=True), jac(fused, (x, r))):
        assert all(torch.equal(g, h) for g, h in zip(got, want))


def test_sparse_output_gradients():
    # Autograd passes a sparse gradient of a dense output on as it is; the backward reads it dense.
    x, r = _rand((3, 16), seed=45), _rand((3, 16), seed=46)
    w = _rand((16,), seed=47).abs() + 0.5
    dy, dro = _rand((3, 16), seed=48), _rand((3, 16), seed=49)
    dy[1] = 0  # a zero row: sparse for real

    def grads(layout):
        grad = (lambda t: t.to_sparse()) if layout == "sparse" else (lambda t: t)
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        plain, = torch.autograd.grad(dsnorm.rms_norm(xs, w), (xs,), grad(dy))
        fused = torch.autograd.grad(dsnorm.fused_add_rms_norm(xs, rs, w), (xs, rs), (grad(dy), grad(dro)))
        return (plain, *fused)

    assert all(bits_equal(a, b) for a, b in zip(grads("sparse"), grads("dense")))


def test_leading_dims_record_no_view_nodes():
    # A [batch, seq, n] call goes into the autograd Function in its own shape: no flattening view is
    # recorded (each was a graph node: ~18 us of a ~87 us training step on the CI machine), and the
    # gradients equal those of the same rows as [rows, n], bit for bit.
    x, r = _rand((2, 3, 32), seed=50).to(torch.bfloat16), _rand((2, 3, 32), seed=51).to(torch.bfloat16)
    w = torch.linspace(0.5, 1.5, 32)
    g, gr = _rand((2, 3, 32), seed=52).to(torch.bfloat16), _rand((2, 3, 32), seed=53).to(torch.bfloat16)
    results = []
    for shape in ((2, 3, 32), (6, 32)):
        xg, rg = x.reshape(shape).clone().requires_grad_(), r.reshape(shape).clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y, res = dsnorm.fused_add_rms_norm(xg, rg, wg)
        z = dsnorm.rms_norm(xg, wg)
        assert y.shape == res.shape == z.shape == shape
        if len(shape) == 3:
            assert type(y.grad_fn).__name__ == "FusedAddRMSNormFunctionBackward"
            assert type(z.grad_fn).__name__ == "RMSNormFunctionBackward"
            assert y.grad_fn.next_functions[0][0].variable is xg  # x reaches the Function unviewed
        torch.autograd.backward((y, res, z), (g.reshape(shape), gr.reshape(shape), g.reshape(shape)))
        results.append((y.reshape(6, 32), res.reshape(6, 32), xg.grad.reshape(6, 32), rg.grad.reshape(6, 32), wg.grad))
    for got, want in zip(*results):
        assert bits_equal(got.detach(), want.detach())


def test_vjp_function_called_after_the_transform():
    # torch.func.vjp's function is called after vjp returned: the Functions' saved inputs are then
    # functorch wrappers of a finished transform (no storage), which take the op, not the kernels.
    x, r = _rand((3, 16), seed=48).float(), _rand((3, 16), seed=49).float()
    w = torch.linspace(0.5, 1.5, 16)
    g = torch.ones(3, 16)
    _, plain_vjp = torch.func.vjp(lambda a, b: dsnorm.rms_norm(a, b), x, w)
    _, fused_vjp = torch.func.vjp(lambda a, b, c: dsnorm.fused_add_rms_norm(a, b, c), x, r, w)
    got_plain, got_fused = plain_vjp(g), fused_vjp((g, g))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    want_plain = torch.autograd.grad(dsnorm.rms_norm(xg, wg), (xg, wg), g)
    xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    want_fused = torch.autograd.grad(dsnorm.fused_add_rms_norm(xg, rg, wg), (xg, rg, wg), (g, g))
    for got, want in zip((*got_plain, *got_fused), (*want_plain, *want_fused)):
        assert bits_equal(got, want)


def test_unused_outputs_reach_the_backward_as_nothing(monkeypatch):
    # Autograd would materialise the gradient of rstd (never differentiable) and of an unused
    # residual_out (the final norm's) as zero tensors, each filled by a kernel, which the backward
    # kernels would then read: they arrive as None, and the gradients are unchanged.
    from dsnorm import ops

    seen = []
    real_fused, real_plain = ops.fused_add_rms_norm_bwd_unchecked, ops.rms_norm_bwd_unchecked

    def fused_spy(dy, x, residual, weight, rstd, dresidual_out, *options):
        seen.append(("fused", dresidual_out))
        return real_fused(dy, x, residual, weight, rstd, dresidual_out, *options)

    def plain_spy(dy, x, weight, rstd):
        seen.append(("plain", dy))
        return real_plain(dy, x, weight, rstd)

    monkeypatch.setattr(ops, "fused_add_rms_norm_bwd_unchecked", fused_spy)
    monkeypatch.setattr(ops, "rms_norm_bwd_unchecked", plain_spy)
    x, r = _rand((3, 48), seed=46).float(), _rand((3, 48), seed=47).float()
    w = torch.linspace(0.5, 1.5, 48)
    xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    y, _ = dsnorm.fused_add_rms_norm(xg, rg, wg)
    gx, gr, gw = torch.autograd.grad(y.pow(2).sum(), (xg, rg, wg))
    xs, ws = (x + r).double().requires_grad_(), w.double().requires_grad_()
    want_x, want_w = torch.autograd.grad(rms_norm_ref(xs, ws).pow(2).sum(), (xs, ws))
    torch.testing.assert_close(gx.double(), want_x, rtol=1e-5, atol=1e-6)
    assert bits_equal(gx, gr)
    torch.testing.assert_close(gw.double(), want_w, rtol=1e-5, atol=1e-6)
    dsnorm.rms_norm(xg, wg).sum().backward()
    assert seen[0] == ("fused", None) and seen[1][0] == "plain" and seen[1][1] is not None


def test_output_gradients_of_another_dtype_shape_or_device_are_handled_by_autograd():
    # The Functions' backward calls the kernels without the backward ops' checks: the saved tensors
    # passed the forward's, and autograd casts an output gradient of another dtype to the output's
    # and refuses another shape or device (what the unchecked call relies on).
    x, r = _rand((3, 40), torch.bfloat16, 70), _rand((3, 40), torch.bfloat16, 71)
    w = torch.linspace(0.5, 1.5, 40)
    dy, dro = _rand((3, 40), torch.float32, 72), _rand((3, 40), torch.float32, 73)

    def grads(gy, gr, fused=True):
        xs, rs, ws = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
        if not fused:
            torch.autograd.backward(dsnorm.rms_norm(xs, ws), gy)
            return xs.grad, ws.grad
        torch.autograd.backward(dsnorm.fused_add_rms_norm(xs, rs, ws), (gy, gr))
        return xs.grad, rs.grad, ws.grad

    for fused in (True, False):
        want = grads(dy.bfloat16(), dro.bfloat16(), fused)
        got = grads(dy, dro, fused)  # fp32 gradients for bf16 outputs
        assert all(bits_equal(a, b) for a, b in zip(got, want))
        with pytest.raises(RuntimeError, match="[Mm]ismatch in shape|shape"):
            grads(dy[:2], dro[:2], fused)
        with pytest.raises(RuntimeError, match="device"):
            grads(dy.to("meta"), dro.to("meta"), fused)


def test_tensor_leaked_from_a_transform_in_grad_mode():
    # The functions call the autograd Functions' C apply directly (skipping Function.apply's
    # signature binding) unless a transform is active or an input is a functorch wrapper left over
    # from a finished one, which Function.apply unwraps: such a tensor gives the plain tensor's
    # values and gradients.
    leaked = []

    def keep(t):
        leaked.append(t)
        return (t * t).sum()

    plain_x, plain_r = _rand((3, 32), seed=44).float(), _rand((3, 32), seed=45).float()
    torch.func.grad(keep)(plain_x)
    x = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(x)
    results = []
    for inp in (x, plain_x):
        w = torch.linspace(0.5, 1.5, 32, requires_grad=True)
        y, res = dsnorm.fused_add_rms_norm(inp, plain_r, w)
        (y.sum() + res.sum()).backward()
        z = dsnorm.rms_norm(inp, w)
        z.pow(2).sum().backward()
        results.append((y.detach(), res.detach(), z.detach(), w.grad))
    for got, want in zip(*results):
        assert bits_equal(got, want)


def test_forward_mode_ad_is_refused_by_name_not_dropped():
    # dsnorm has no jvp formula: a dual input used to lose its tangent silently (the lane and the
    # ops ignore it). It is refused by name; inside a dual level, plain inputs still work.
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    r, w = torch.randn(3, 64, generator=g), torch.rand(64, generator=g) + 0.5
    m = dsnorm.RMSNorm(64)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), fwAD.dual_level():
            d = fwAD.make_dual(x, t)
            for call in (lambda: dsnorm.rms_norm(d, w), lambda: dsnorm.fused_add_rms_norm(d, r, w),
                         lambda: m(d), lambda: m(x, d), lambda: dsnorm.rms_norm_fp8(d, w),
                         lambda: dsnorm.mla_latent_norms(d, torch.randn(3, 80), w, w[:32])):
                with pytest.raises(NotImplementedError, match="no forward-mode AD"):
                    call()
            xi, ri = x.clone(), r.clone()
            with pytest.raises(NotImplementedError, match="fused_add_rms_norm_ has no forward-mode AD"):
                dsnorm.fused_add_rms_norm_(fwAD.make_dual(xi, t), ri, w)
            assert torch.equal(xi, x) and torch.equal(ri, r)
            assert torch.equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w))


def test_jit_trace_records_a_serialisable_op_in_grad_mode():
    # The reference class traces under torch.jit.trace; so must the drop-in, in grad mode (jit.trace
    # re-runs the model under no_grad to check the graph) and through torch.jit.save / load.
    import io

    g = torch.Generator().manual_seed(8)
    m = dsnorm.RMSNorm(129)
    with torch.no_grad():
        m.weight.copy_(torch.rand(129, generator=g) + 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(129, 129), m)
    x, r = torch.randn(3, 129, generator=g), torch.randn(3, 129, generator=g)
    traced = torch.jit.trace(model, (x,))
    assert "dsnorm::rms_norm_fwd" in str(traced.inlined_graph)
    assert torch.equal(traced(x), model(x))
    xs, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    traced(xs).sum().backward()
    w_traced, m.weight.grad = m.weight.grad.clone(), None
    model(xe).sum().backward()
    assert torch.equal(xs.grad, xe.grad) and torch.equal(w_traced, m.weight.grad)
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    buf.seek(0)
    assert torch.equal(torch.jit.load(buf)(x), model(x))
    fused = torch.jit.trace(m, (x, r))
    assert all(torch.equal(a, b) for a, b in zip(fused(x, r), m(x, r)))


def test_torch_export_keeps_the_ops_and_the_bits(tmp_path):
    # torch.export is the deployment route (AOTInductor, in a Python process that imported dsnorm):
    # the ops must appear in the exported graph as themselves (not traced through into aten), survive
    # save / load and run_decompositions, take a dynamic batch, and give the eager bits and gradients.
    g = torch.Generator().manual_seed(9)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(65, 65)
            self.attn_norm, self.ffn_norm = dsnorm.RMSNorm(65), dsnorm.RMSNorm(65)

        def forward(self, x, residual):
            h, residual = self.attn_norm(x, residual)
            return self.ffn_norm(self.lin(h)), residual

    model = Block()
    with torch.no_grad():
        model.attn_norm.weight.copy_(torch.rand(65, generator=g) + 0.5)
    x, r = torch.randn(2, 3, 65, generator=g), torch.randn(2, 3, 65, generator=g)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(model, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    code = ep.graph_module.code
    assert "dsnorm.fused_add_rms_norm_fwd" in code and "dsnorm.rms_norm_fwd" in code
    path = tmp_path / "block.pt2"
    torch.export.save(ep, str(path))
    for exported in (ep, torch.export.load(str(path)), ep.run_decompositions()):
        for rows in (2, 5):
            xb, rb = torch.randn(rows, 3, 65, generator=g), torch.randn(rows, 3, 65, generator=g)
            assert all(torch.equal(a, b) for a, b in zip(exported.module()(xb, rb), model(xb, rb)))
    # Gradients through the exported module equal eager ones (the ops' autograd is registered).
    xa, ra = x.clone().requires_grad_(), r.clone().requires_grad_()
    xe, re_ = x.clone().requires_grad_(), r.clone().requires_grad_()
    exported = ep.module()
    y, s = exported(xa, ra)
    (y.sum() + s.pow(2).sum()).backward()
    y, s = model(xe, re_)
    (y.sum() + s.pow(2).sum()).backward()
    assert torch.equal(xa.grad, xe.grad) and torch.equal(ra.grad, re_.grad)
    assert torch.equal(dict(exported.named_parameters())["attn_norm.weight"].grad, model.attn_norm.weight.grad)

    # The in-place form exports as a mutation of its inputs (functionalised by run_decompositions).
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(65, generator=g) + 0.5)

        def forward(self, x, residual):
            dsnorm.fused_add_rms_norm_(x, residual, self.weight)
            return x, residual

    xb, rb = x.to(torch.bfloat16), r.to(torch.bfloat16)
    inplace = InPlace()
    with torch.no_grad():
        want = inplace(xb.clone(), rb.clone())
        ep = torch.export.export(inplace, (xb.clone(), rb.clone()))
        for exported in (ep, ep.run_decompositions()):
            xi, ri = xb.clone(), rb.clone()
            exported.module()(xi, ri)
            assert torch.equal(xi, want[0]) and torch.equal(ri, want[1])


def test_an_aot_inductor_package_gives_the_eager_bits(tmp_path):
    # AOTInductor compiles the exported graph to a shared library around the ops, which it calls back
    # through the dispatcher: a decode block (fused norm, plain norm on a projection, kv_norm on a
    # strided slice, the chained fused norm) with dynamic batch and length, run from the package.
    g = torch.Generator().manual_seed(12)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq_a, self.wkv_a = torch.nn.Linear(96, 48), torch.nn.Linear(96, 40)
            self.attn_norm, self.ffn_norm = dsnorm.RMSNorm(96), dsnorm.RMSNorm(96)
            self.q_norm, self.kv_norm = dsnorm.RMSNorm(48), dsnorm.RMSNorm(32)

        def forward(self, x, residual):
            h, residual = self.attn_norm(x, residual)
            q = self.q_norm(self.wq_a(h))
            kv = self.kv_norm(self.wkv_a(h)[..., :32])  # 32 of 40 columns, read in place
            return self.ffn_norm(h, residual) + (q, kv)

    model = Block().to(torch.bfloat16)
    with torch.no_grad():
        for norm in (model.attn_norm, model.ffn_norm, model.q_norm, model.kv_norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)

    def inputs(b, t):
        return tuple(torch.randn(b, t, 96, generator=g).to(torch.bfloat16) for _ in range(2))

    dims = {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("tokens", max=512)}
    with torch.no_grad():  # an inference graph records the inference ops, not the training ones
        ep = torch.export.export(model, inputs(2, 3), dynamic_shapes=(dims, dims))
        assert "dsnorm.fused_add_rms_norm.default" in ep.graph_module.code
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        for b, t in ((1, 1), (5, 1), (1, 17)):
            args = inputs(b, t)
            got, want = runner(*args), model(*args)
            assert len(got) == 4 and all(torch.equal(a, e) for a, e in zip(got, want)), (b, t)


def test_second_derivatives_are_refused_not_wrong():
    # A second derivative through dsnorm's gradients raises by name on every route: autograd.grad
    # with respect to the inputs (not only .backward()), torch.func.grad of grad, and the forward
    # ops called directly (as traced models do). It was silently wrong (off by ~10) for a while.
    from torch.func import grad

    x = _rand((3, 64), seed=50).requires_grad_(True)
    r = _rand((3, 64), seed=51).requires_grad_(True)
    w = (torch.rand(64, dtype=torch.float64) + 0.5).requires_grad_(True)
    firsts = {
        "rms_norm": lambda: dsnorm.rms_norm(x, w).pow(2).sum() + x.pow(3).sum(),
        "fused_add_rms_norm": lambda: dsnorm.fused_add_rms_norm(x, r, w)[0].pow(2).sum() + x.pow(3).sum(),
        "rms_norm_fwd": lambda: torch.ops.dsnorm.rms_norm_fwd(x, w, 1e-6, "deepseek")[0].pow(2).sum() + x.pow(3).sum(),
        "fused_add_rms_norm_fwd": lambda: torch.ops.dsnorm.fused_add_rms_norm_fwd(
            x, r, w, 1e-6, "deepseek", "fp32_sum", None)[0].pow(2).sum() + x.pow(3).sum(),
    }
    for name, loss in firsts.items():
        (g,) = torch.autograd.grad(loss(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=f"dsnorm.{name} has no second derivative"):
            torch.autograd.grad(g.pow(2).sum(), x)
    wd = w.detach()
    with pytest.raises(RuntimeError, match="has no second derivative"):
        grad(lambda t: grad(lambda u: dsnorm.rms_norm(u, wd).pow(2).sum())(t).sum())(x.detach())


def test_the_ops_refuse_forward_mode_ad():
    import torch.autograd.forward_ad as fwAD

    x, w, r = _rand((3, 64), torch.float32, 60), torch.rand(64) + 0.5, _rand((3, 64), torch.float32, 61)
    with fwAD.dual_level():
        d = fwAD.make_dual(x, torch.ones_like(x))
        for call in (lambda: torch.ops.dsnorm.rms_norm(d, w, 1e-6, "deepseek"),
                     lambda: torch.ops.dsnorm.rms_norm_fwd(d, w, 1e-6, "deepseek"),
                     lambda: torch.ops.dsnorm.fused_add_rms_norm(d, r, w, 1e-6, "deepseek", "fp32_sum", None),
                     lambda: torch.ops.dsnorm.fused_add_rms_norm_fwd(d, r, w, 1e-6, "deepseek", "fp32_sum", None)):
            with pytest.raises(NotImplementedError, match="no forward-mode AD"):
                call()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inputs_made_under_inference_mode_train_the_gain(dtype):
    # Cached inputs (made under inference_mode) with a gain being trained: autograd cannot save an
    # inference tensor, so its values are kept in a copy; gradients as the reference's.
    with torch.inference_mode():
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        r = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    for fused in (False, True):
        grads = []
        for cls in (dsnorm.RMSNormRef, dsnorm.RMSNorm):
            m = cls(64)
            y = m(x, r)[0] if fused else m(x)
            y.float().square().sum().backward()
            grads.append(m.weight.grad)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_built_under_inference_mode_runs_with_grad_enabled(dtype):
    # A model built (or loaded) under inference_mode, then called in grad mode: its weight is an
    # inference tensor that requires grad, which autograd cannot save. The reference runs these
    # calls (its mul saves only x) and even trains the gain; dsnorm raised (found by review).
    with torch.inference_mode():
        mods = [cls(64) for cls in (dsnorm.RMSNormRef, dsnorm.RMSNorm)]
        for m in mods:
            m.weight.mul_(torch.linspace(0.5, 1.5, 64))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    r = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    for fused in (False, True):
        outs, grads = [], []
        for m in mods:
            m.weight.grad = None
            out = m(x, r) if fused else (m(x),)
            out[0].float().square().sum().backward()
            outs.append(out)
            grads.append(m.weight.grad)
        assert all(bits_equal(a, b) for a, b in zip(*outs))
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
        # The functions too, with the weight passed directly.
        y = dsnorm.rms_norm(x, mods[1].weight) if not fused else dsnorm.fused_add_rms_norm(x, r, mods[1].weight)[0]
        assert bits_equal(y, outs[0][0])


def _rand_scaled(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# Kills: cpu/kernels.py _backward_block without `if round_first: round_row(buf, n, x_code)` (the CPU
# backward of residual_rounding="round_first" is only ever gradchecked in fp64, where rounding to
# x.dtype is the identity, and compared with itself in the DTensor test).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_first_backward_values(dtype):
    shape = (16, 769)
    x, r = _rand_scaled(shape, dtype, 40), _rand_scaled(shape, dtype, 41, 4.0)
    w = _rand_scaled(shape[-1:], torch.float32, 42)
    dy, dro = _rand_scaled(shape, dtype, 43), _rand_scaled(shape, dtype, 44)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, res = dsnorm.fused_add_rms_norm(xs, rs, ws, residual_rounding="round_first")
    torch.autograd.backward((y, res), (dy, dro))
    s = (x.double() + r.double()).to(dtype).double()  # round_first normalises the rounded sum
    ds_ref, dw_ref = rms_norm_backward_ref(dy, s, w)
    ds_ref = ds_ref + dro.double()
    assert ((ws.grad.double() - dw_ref).norm() / dw_ref.norm()).item() < 1e-5
    assert max_ulp(xs.grad, ds_ref.to(dtype)) <= 1 and max_ulp(rs.grad, ds_ref.to(dtype)) <= 1


@pytest.mark.parametrize("dtype, res_dtype, stream", [
    (torch.float32, torch.float32, None), (torch.bfloat16, torch.bfloat16, None),
    (torch.bfloat16, torch.float32, None), (torch.bfloat16, torch.float16, torch.float32)])
def test_only_the_new_residual_used(dtype, res_dtype, stream):
    # y unused (only the residual stream goes on): as in the reference's graph the gradient reaches
    # x and residual through s = x + residual alone, rounded to each one's dtype, and the weight
    # gets none: its .grad stays None (a zero gradient would still move it under weight decay), and
    # an infinite x (s) gives no NaN (the norm's xhat * 0 would).
    x, r = _rand((3, 64), dtype, 91), _rand((3, 64), res_dtype, 92)
    x[0, 0] = float("inf")
    dro = _rand((3, 64), stream or dtype, 93)
    for norm in (dsnorm.RMSNorm(64, residual_dtype=stream), RMSNormRef(64) if stream is None else None):
        if norm is None:
            continue
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        y, res = norm(xs, rs)
        res.backward(dro)
        assert norm.weight.grad is None, type(norm).__name__
        assert bits_equal(xs.grad, dro.to(dtype)) and bits_equal(rs.grad, dro.to(res_dtype)), type(norm).__name__


# The fp32 residual stream's gradients are checked for dtype only (test_fp32_residual_stream_
# gradient_dtype); a kernel writing dresidual with x's code, or reading dresidual_out with it, was
# caught only incidentally by the DTensor test (uninitialised memory / shard offsets differing).
# Also a residual of another dtype than x's with the stream in x's dtype (the reference's
# residual.float() under torch.autocast): dresidual comes back in the residual's own dtype.
@pytest.mark.parametrize("dtype, res_dtype, stream", [
    (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, None),
    (torch.bfloat16, torch.float16, None), (torch.float32, torch.bfloat16, None)])
def test_fp32_residual_stream_gradient_values(dtype, res_dtype, stream):
    shape = (8, 512)
    x, r = _rand_scaled(shape, dtype, 45), _rand_scaled(shape, res_dtype, 46)
    w = _rand_scaled(shape[-1:], torch.float32, 47)
    dy, dro = _rand_scaled(shape, dtype, 48), _rand_scaled(shape, stream or dtype, 49)
    xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
    y, res = dsnorm.fused_add_rms_norm(xs, rs, ws, residual_dtype=stream)
    torch.autograd.backward((y, res), (dy, dro))
    assert xs.grad.dtype == dtype and rs.grad.dtype == res_dtype
    ds_ref, dw_ref = rms_norm_backward_ref(dy, x.double() + r.double(), w)
    ds_ref = ds_ref + dro.double()
    for grad in (xs.grad, rs.grad):
        if grad.dtype == torch.float32:
            torch.testing.assert_close(grad.double(), ds_ref, rtol=1e-5, atol=1e-5)
        else:
            assert max_ulp(grad, ds_ref.to(grad.dtype)) <= 1
    assert ((ws.grad.double() - dw_ref).norm() / dw_ref.norm()).item() < 1e-5


# The training lane (ops.train_lane_plain / train_lane_fused): the forward's common case proved in
# one expression in place of the argument checks; everything else takes the general path.


def _lane_off(monkeypatch):
    from dsnorm import ops

    monkeypatch.setattr(ops, "train_lane_plain", lambda *a: False)
    monkeypatch.setattr(ops, "train_lane_fused", lambda *a: False)


def _train(monkeypatch, x, r, w, **options):
    """y, residual_out and every gradient of one fused and one plain training call (both outputs
    used), and whether each call took the lane."""
    with monkeypatch.context() as patched:
        calls = count_lane_calls(patched)
        xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
        y, ro = dsnorm.fused_add_rms_norm(xs, rs, ws, **options)
        z = dsnorm.rms_norm(xs, ws, cast=options.get("cast", "deepseek"))
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)
        torch.autograd.backward((y, ro, z), (g, g.flip(-1), g))
    assert type(y.grad_fn).__name__ == "FusedAddRMSNormFunctionBackward"  # one node class either way
    assert type(z.grad_fn).__name__ == "RMSNormFunctionBackward"
    return (y, ro, z, xs.grad, rs.grad, ws.grad), (calls[1] == 1, calls[0] == 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64,), (3, 111), (2, 3, 64)])
@pytest.mark.parametrize("options", [{}, {"cast": "hf"}, {"residual_rounding": "round_first"}])
def test_training_lane_gives_the_general_paths_bits(monkeypatch, dtype, shape, options):
    x, r = _rand(shape, dtype, 80), _rand(shape, dtype, 81)
    w = _rand(shape[-1:], torch.float64 if dtype == torch.float64 else torch.float32, 82)
    _train(monkeypatch, x, r, w, **options)  # the options are checked once on the general path
    got, lanes = _train(monkeypatch, x, r, w, **options)
    assert lanes == (True, True)
    with monkeypatch.context() as patched:
        _lane_off(patched)
        want, lanes = _train(monkeypatch, x, r, w, **options)
    assert lanes == (False, False)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and bits_equal(a.detach(), b.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_training_lane_reads_strided_rows_in_place(monkeypatch, dtype):
    # kv_norm's input in training: a 512-of-576 slice of wkv_a's output, read in place by the lane
    # as by the general path; the same bits either way.
    wide_x, wide_r = _rand((2, 3, 576), dtype, 100), _rand((2, 3, 576), dtype, 101)
    w = _rand((512,), torch.float32, 102)

    def train():
        with monkeypatch.context() as patched:
            calls = count_lane_calls(patched)
            xs, rs, ws = wide_x.clone().requires_grad_(), wide_r.clone().requires_grad_(), w.clone().requires_grad_()
            y, ro = dsnorm.fused_add_rms_norm(xs[..., :512], rs[..., :512], ws)
            z = dsnorm.rms_norm(xs[..., 64:], ws)
            g = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dtype)
            torch.autograd.backward((y, ro, z), (g, g.flip(-1), g))
        return (y, ro, z, xs.grad, rs.grad, ws.grad), (calls[1], calls[0])

    train()
    got, lanes = train()
    assert lanes == (1, 1)
    with monkeypatch.context() as patched:
        _lane_off(patched)
        want, lanes = train()
    assert lanes == (0, 0)
    for a, b in zip(got, want):
        assert bits_equal(a.detach(), b.detach())


def _raised(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 (the test compares whatever is raised)
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", [
    "weight length", "weight 2-D", "residual shape", "residual dtype", "x 0-d",
    "x width 0", "eps 0", "eps nan", "eps -1", "eps str", "eps list", "cast", "rounding", "rounding list",
    "round_first fp32 stream",
])
def test_training_lane_refuses_by_the_general_paths_errors(monkeypatch, case):
    # Requires-grad arguments the lane must not take: each raises what the general path raises.
    x, r = _rand((3, 64), torch.bfloat16, 83), _rand((3, 64), torch.bfloat16, 84)
    w = torch.ones(64)
    kwargs = {}
    if case == "weight length":
        w = torch.ones(63)
    elif case == "weight 2-D":
        w = torch.ones(1, 64)
    elif case == "residual shape":
        r = r[:2]
    elif case == "residual dtype":
        r = r.double()  # bf16, fp16 and fp32 residuals are taken (widened, as the reference's .float())
    elif case == "x 0-d":
        x, r = x[0, 0], r[0, 0]
    elif case == "x width 0":
        x, r = x[:, :0], r[:, :0]
    elif case.startswith("eps"):
        kwargs["eps"] = {"eps 0": 0.0, "eps nan": float("nan"), "eps -1": -1.0, "eps str": "1e-6",
                         "eps list": [1e-6]}[case]
    elif case == "cast":
        kwargs["cast"] = "HF"
    elif case == "rounding":
        kwargs["residual_rounding"] = "fp32"
    elif case == "rounding list":
        kwargs["residual_rounding"] = ["fp32_sum"]
    elif case == "round_first fp32 stream":
        kwargs.update(residual_rounding="round_first", residual_dtype=torch.float32)
    plain_kwargs = {k: v for k, v in kwargs.items() if k in ("eps", "cast")}

    def calls():
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        ws = w.clone().requires_grad_()
        return (_raised(lambda: dsnorm.fused_add_rms_norm(xs, rs, ws, **kwargs)),
                _raised(lambda: dsnorm.rms_norm(xs, ws, **plain_kwargs)))

    got = calls()
    with monkeypatch.context() as patched:
        _lane_off(patched)
        want = calls()
    assert got == want
    assert got[0] is not None  # every case is an error of the fused call


def test_training_lane_leaves_other_tensors_to_the_general_path(monkeypatch):
    # Rows the kernels cannot read in place, a lazily negated view, an inference tensor and an fp32
    # residual stream take the general path; a Parameter input is a plain tensor (the lane).
    w = _rand((64,), torch.float32, 84)  # not all ones: the bitwise check below then sees the multiply order
    z = torch.complex(_rand((3, 64), torch.float32, 86), _rand((3, 64), torch.float32, 87))
    with torch.inference_mode():
        frozen = _rand((3, 64), torch.float32, 88)
    r = _rand((3, 64), torch.float32, 89).requires_grad_()
    cases = {
        "column stride": (_rand((64, 3), torch.float32, 85).t().requires_grad_(), r, {}, 0),
        "negated view": (z.requires_grad_().conj().imag, r, {}, 0),
        "inference": (frozen, r, {}, 0),
        "fp32 stream": (_rand((3, 64), torch.bfloat16, 90).requires_grad_(), r, {"residual_dtype": torch.float32}, 0),
        "parameter": (torch.nn.Parameter(_rand((3, 64), torch.float32, 91)), r, {}, 1),
    }
    dsnorm.fused_add_rms_norm(r.detach(), r, w)  # the default options checked once
    for name, (x, res, kwargs, lane) in cases.items():
        with monkeypatch.context() as patched:
            calls = count_lane_calls(patched)
            y, ro = dsnorm.fused_add_rms_norm(x, res, w, **kwargs)
        assert calls[1] == lane, name
        want_y = rms_norm_ref(x.detach().resolve_neg().contiguous().float() + res.detach().float(), w).to(x.dtype)
        assert_y_close(y.detach(), want_y, 64)  # bitwise on x86 (README), one ulp elsewhere
        (y.float().sum() + ro.float().sum()).backward()


def test_chain_shares_the_residual_gradient_between_lane_and_general_calls(monkeypatch):
    # The first norm takes the general path (x's columns strided), the second the lane: the
    # second's residual is still recognised as a fused norm's residual_out.
    w = torch.ones(96)
    a = _rand((96, 4), torch.float32, 92).t().requires_grad_()
    b, c = (_rand((4, 96), torch.float32, s).requires_grad_() for s in (93, 94))
    dsnorm.fused_add_rms_norm(b.detach(), c, w)  # the default options checked once
    with monkeypatch.context() as patched:
        calls = count_lane_calls(patched)
        y1, r1 = dsnorm.fused_add_rms_norm(a, b, w)
        assert calls[1] == 0
        y2, r2 = dsnorm.fused_add_rms_norm(c, r1, w)
        assert calls[1] == 1
    gc, gr1 = torch.autograd.grad((y2, r2), (c, r1), (torch.ones_like(y2), torch.ones_like(r2)))
    assert gc is gr1


def test_compiled_training_does_not_recompile_after_eager_calls_check_new_options():
    # The training lane's proof is not traced by dynamo: it reads the cache of accepted options,
    # which eager calls with new options grow, and a guard on it would recompile (and raise under
    # the fail_on_recompile stance a server sets after warm-up).
    torch._dynamo.reset()
    w = torch.rand(64, generator=torch.Generator().manual_seed(95)) + 0.5

    def step(x, r):
        y, ro = dsnorm.fused_add_rms_norm(x, r, w)
        return dsnorm.rms_norm(y, w) + ro

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, r = (_rand((4, 64), torch.float32, s).requires_grad_() for s in (96, 97))
    compiled(x, r).sum().backward()
    for eps in (3.3e-5, 4.4e-5):  # options no call has checked before: the cache grows
        dsnorm.fused_add_rms_norm(x, r, w, eps)
        dsnorm.rms_norm(x, w, eps)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled(x, r).sum().backward()


def test_compiled_autograd_sees_one_node_class_from_the_first_step():
    # The first call with new options takes the general path (the lane needs them checked before),
    # later ones the lane: both record the same Function's node, so compiled autograd, which keys
    # its graphs on the node classes, does not recompile after the first step.
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    x, w = _rand((4, 64), torch.float32, 98).requires_grad_(), _rand((64,), torch.float32, 99).requires_grad_()

    def step(eps):
        y = dsnorm.rms_norm(x, w, eps)
        assert y.grad_fn._forward_cls is dsnorm.autograd.RMSNormFunction
        with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")):
            y.sum().backward()
        x.grad = w.grad = None  # every step the same graph: .grad set, not accumulated

    eps = 1.25e-5  # options no call has checked before
    step(eps)
    with torch.compiler.set_stance("fail_on_recompile"):
        step(eps)
        step(eps)
