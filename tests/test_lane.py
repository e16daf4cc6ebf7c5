"""The fast lane (dsnorm.cpu.lane.lane) and RMSNorm.__call__: same bits and same refusals as the
general path, and they step aside for everything the general path exists for (autograd,
dispatch modes, hooks, bad arguments)."""

import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsnorm
from dsnorm import ops
from dsnorm.ref import RMSNormRef, fused_add_rms_norm_ref, rms_norm_ref

from conftest import bits_equal

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _data(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _weight(n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) + 0.5


@pytest.fixture
def lane_only(monkeypatch):
    """Make the general CPU path fail loudly: whatever still succeeds went through the lane."""
    dsnorm.rms_norm(torch.ones(1, 8), torch.ones(8))  # installs the lane
    assert ops.lane is not None

    def general(*args, **kwargs):
        raise AssertionError("the general path ran")

    for name in ("_plain", "_fused", "fused_add_rms_norm_inplace", "_launcher"):
        monkeypatch.setattr(ops, name, general)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (4, 1, 7168), (3, 512), (1, 111)])
def test_lane_matches_reference(lane_only, dtype, shape):
    n = shape[-1]
    x, r, w = _data(shape, dtype, 1), _data(shape, dtype, 2), _weight(n)
    with torch.no_grad():
        assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w))
        for cast in ("deepseek", "hf"):
            for rounding in ("fp32_sum", "round_first"):
                y, res = dsnorm.fused_add_rms_norm(x, r, w, cast=cast, residual_rounding=rounding)
                y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, cast=cast, residual_rounding=rounding)
                assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
                xi, ri = x.clone(), r.clone()
                out = dsnorm.fused_add_rms_norm_(xi, ri, w, cast=cast, residual_rounding=rounding)
                assert out[0] is xi and out[1] is ri
                assert bits_equal(xi, y_ref) and bits_equal(ri, res_ref)


@pytest.mark.parametrize("wdtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1536), (64, 1, 7168), (1, 1, 9000), (3, 111)])
def test_lane_widens_a_narrow_gain(lane_only, dtype, wdtype, shape):
    # vLLM keeps gains in the model's dtype: the functions widen one exactly, and so does the lane
    # (no general path runs), for every form, both casts, strided rows and an fp32 residual stream.
    n = shape[-1]
    x, r, w = _data(shape, dtype, 21), _data(shape, dtype, 22), _weight(n).to(wdtype)
    w32 = w.float()
    with torch.no_grad():
        for cast in ("deepseek", "hf"):
            assert bits_equal(dsnorm.rms_norm(x, w, cast=cast), rms_norm_ref(x, w32, cast=cast))
            xs = _data((*shape[:-1], n + 3), dtype, 24)[..., 3:]  # rows with a stride
            assert bits_equal(dsnorm.rms_norm(xs, w, cast=cast), rms_norm_ref(xs, w32, cast=cast))
            for rdt in (None, torch.float32):
                got = dsnorm.fused_add_rms_norm(x, r, w, cast=cast, residual_dtype=rdt)
                want = fused_add_rms_norm_ref(x, r, w32, cast=cast, residual_dtype=rdt)
                assert all(map(bits_equal, got, want))
            xi, ri = x.clone(), r.clone()
            dsnorm.fused_add_rms_norm_(xi, ri, w, cast=cast)
            assert all(map(bits_equal, (xi, ri), fused_add_rms_norm_ref(x, r, w32, cast=cast)))
        norm = dsnorm.RMSNorm(n).to(wdtype)
        norm.weight.copy_(w)
        assert bits_equal(norm(x), rms_norm_ref(x, w32))


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
@pytest.mark.parametrize("n_nested", (7168, 9000))  # 9000: past the row's first size, a new row
@pytest.mark.parametrize("rows", (1, 4))  # the decode kernel's own widening; a threaded call's row
def test_a_call_from_a_signal_handler_keeps_the_narrow_gain_of_the_call_it_interrupts(rows, n_nested, threads):
    # Python runs signal handlers (and, from 3.12, the GC's finalizers) between two bytecodes: one
    # that runs a norm on the same thread in the middle of a lane call must not leave that call
    # with its own widened gain (or a freed row).
    torch.set_num_threads(2)  # 4 rows: a threaded call, which widens into the thread's row
    x, w = torch.ones(rows, 7168, dtype=torch.bfloat16), torch.ones(7168, dtype=torch.bfloat16)
    x2, w2 = torch.ones(rows, n_nested, dtype=torch.bfloat16), torch.full((n_nested,), 3.0, dtype=torch.bfloat16)
    want = rms_norm_ref(x, w.float())
    handled, running = [], []

    def handler(*_):
        if running:  # a signal during the handler's own call (a loaded machine): not nested further
            return
        running.append(True)
        try:
            handled.append(dsnorm.rms_norm(x2, w2))
        finally:
            running.clear()

    with torch.no_grad():  # compiled and loaded first: a handler slower than the timer never returns
        dsnorm.rms_norm(x, w), handler()
    handled.clear()
    previous = signal.signal(signal.SIGALRM, handler)
    wrong = 0
    try:
        signal.setitimer(signal.ITIMER_REAL, 1e-4 * rows, 1e-4 * rows)
        with torch.no_grad():
            for _ in range(20000):
                wrong += not bits_equal(dsnorm.rms_norm(x, w), want)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(handled) > 100, "too few signals arrived to test anything"
    assert wrong == 0, f"{wrong} of 20000 calls used the interrupting call's gain"
    assert bits_equal(handled[-1], rms_norm_ref(x2, w2.float()))


def test_ops_refuse_a_narrow_gain_the_functions_widen():
    # The op's schema takes the compute-dtype gain: its lane declines a bf16 one, and the check names it.
    x, w = _data((2, 64), torch.bfloat16, 23), _weight(64).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(TypeError, match="weight must be torch.float32"):
        torch.ops.dsnorm.rms_norm(x, w, 1e-6, "deepseek")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 200])  # 200 x 512 rows: past the serial kernel's size
def test_lane_strided_rows(lane_only, dtype, rows):
    # The kv_norm input: 512 of each 576-wide row of wkv_a(x), read in place.
    base = _data((rows, 1, 576), dtype, 16)
    x = base[..., :512]
    w = _weight(512)
    with torch.no_grad():
        y = dsnorm.rms_norm(x, w)
    assert y.is_contiguous() and bits_equal(y, rms_norm_ref(x, w))


@pytest.mark.parametrize("shape", [(64, 1, 7168), (9, 9000)])
def test_lane_large_calls(lane_only, shape):
    n = shape[-1]
    x, r, w = _data(shape, torch.bfloat16, 17), _data(shape, torch.bfloat16, 18), _weight(n)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    with torch.no_grad():
        assert bits_equal(dsnorm.rms_norm(x, w), rms_norm_ref(x, w))
        y, res = dsnorm.fused_add_rms_norm(x, r, w)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)
        dsnorm.fused_add_rms_norm_(x, r, w)
    assert bits_equal(x, y_ref) and bits_equal(r, res_ref)


def test_module_lane_matches_reference(lane_only):
    ref = RMSNormRef(7168)
    ours = dsnorm.RMSNorm(7168)
    with torch.no_grad():
        ref.weight.copy_(_weight(7168))
        ours.weight.copy_(ref.weight)
        x, r = _data((2, 1, 7168), torch.bfloat16, 3), _data((2, 1, 7168), torch.bfloat16, 4)
        assert bits_equal(ours(x), ref(x))
        assert bits_equal(ours(x, None), ref(x))
        for a, b in zip(ours(x, r), ref(x, r)):
            assert bits_equal(a, b)


def test_lane_fp32_residual_stream(lane_only):
    x, r, w = _data((2, 64), torch.float32, 5), _data((2, 64), torch.float32, 6), _weight(64)
    with torch.no_grad():
        y, res = dsnorm.fused_add_rms_norm(x, r, w, residual_dtype=torch.float32)
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, residual_dtype=torch.float32)
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 200])  # 200 x 512 rows: past the serial kernel's size
def test_fused_lane_takes_strided_x_and_mixed_residuals(lane_only, dtype, rows):
    # The fused form's other common calls went through the general path (~10 µs more at decode,
    # 0.66-0.85x of eager torch with an fp32 stream, found by a performance review): x in strided
    # rows (a 512-of-576 slice), a residual of another dtype (an fp32 stream beside a bf16 x, or
    # the reverse), and residual_dtype=torch.float32 for every x dtype.
    base = _data((rows, 1, 576), dtype, 30)
    w = _weight(512)
    cases = [(base[..., :512], _data((rows, 1, 512), dtype, 31), {})]
    for r_dtype in DTYPES:
        r = _data((rows, 1, 512), r_dtype, 32)
        cases += [(base[..., :512], r, {}), (base[..., :512].contiguous(), r, {}),
                  (base[..., :512].contiguous(), r, {"residual_dtype": torch.float32}),
                  (base[..., :512], r, {"residual_dtype": torch.float32, "cast": "hf"}),
                  (base[..., :512], r, {"residual_rounding": "round_first"})]
    with torch.no_grad():
        for x, r, options in cases:
            y, res = dsnorm.fused_add_rms_norm(x, r, w, **options)
            y_ref, res_ref = fused_add_rms_norm_ref(x, r, w, **options)
            assert y.is_contiguous() and res.is_contiguous() and res.dtype == res_ref.dtype, (r.dtype, options)
            if x.is_contiguous():  # one row of a slice: x's strides, as the general path's empty_like gives
                assert y.stride() == res.stride() == x.stride(), (r.dtype, options)
            assert bits_equal(y, y_ref) and bits_equal(res, res_ref), (r.dtype, options)


def test_inplace_lane_bumps_versions(lane_only):
    x, r, w = _data((1, 1536), torch.bfloat16, 7), _data((1, 1536), torch.bfloat16, 8), _weight(1536)
    vx, vr = x._version, r._version
    with torch.no_grad():
        dsnorm.fused_add_rms_norm_(x, r, w)
    assert x._version > vx and r._version > vr


def test_lane_steps_aside_for_autograd():
    x = _data((1, 1, 1536), torch.bfloat16, 9).requires_grad_()
    m = dsnorm.RMSNorm(1536)
    dsnorm.rms_norm(x.detach(), m.weight.detach())
    y = m(x)
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert x.grad is not None and m.weight.grad is not None
    # only the input requires grad (a frozen norm)
    x.grad = None
    w = m.weight.detach()
    for y in (dsnorm.rms_norm(x, w), dsnorm.fused_add_rms_norm(x, x.detach(), w)[0]):
        assert y.grad_fn is not None
        y.float().sum().backward()
        assert x.grad is not None
        x.grad = None


def test_lane_steps_aside_for_jit_trace():
    w = _weight(64)
    dsnorm.rms_norm(torch.ones(1, 64), w)
    with torch.no_grad():
        traced = torch.jit.trace(lambda t: dsnorm.rms_norm(t, w), (_data((2, 64), torch.bfloat16, 19),))
        other = _data((2, 64), torch.bfloat16, 20)
        assert bits_equal(traced(other), rms_norm_ref(other, w))


def test_module_respects_overridden_forward():
    class Scaled(dsnorm.RMSNorm):
        def forward(self, x, residual=None):
            return super().forward(x * 2, residual)

    x = _data((1, 64), torch.bfloat16, 21)
    with torch.no_grad():
        m = Scaled(64)
        m(x)
        assert bits_equal(m(x), rms_norm_ref(x * 2, m.weight))
        plain = dsnorm.RMSNorm(64)
        plain(x)
        calls = []
        original = plain.forward

        def wrapper(*args, **kwargs):  # what accelerate's add_hook_to_module does
            calls.append(1)
            return original(*args, **kwargs)

        plain.forward = wrapper
        plain(x)
        assert calls == [1]


def test_module_under_fx_leaf_tracing():
    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, dsnorm.RMSNorm) or super().is_leaf_module(m, qualname)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = dsnorm.RMSNorm(64)

        def forward(self, x):
            return self.norm(x)

    block = Block()
    with torch.no_grad():
        block(torch.ones(1, 64))  # the lane is installed
    graph = Leaf().trace(block)
    assert any(node.op == "call_module" and node.target == "norm" for node in graph.nodes)
    x = _data((3, 64), torch.bfloat16, 22)
    with torch.no_grad():
        assert bits_equal(torch.fx.GraphModule(block, graph)(x), rms_norm_ref(x, block.norm.weight))


def test_fused_strided_inputs_take_the_general_path(monkeypatch):
    base_x, base_r = _data((4, 1, 576), torch.bfloat16, 23), _data((4, 1, 576), torch.bfloat16, 24)
    x, r, w = base_x[..., :512], base_r[..., :512], _weight(512)
    calls = []
    general = ops._fused
    monkeypatch.setattr(ops, "_fused", lambda *args: calls.append(1) or general(*args))
    with torch.no_grad():
        y, res = dsnorm.fused_add_rms_norm(x, r, w)
    assert calls == [1]  # both paths give these bits: the name's claim is the path
    y_ref, res_ref = fused_add_rms_norm_ref(x, r, w)
    assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_lane_steps_aside_for_dispatch_modes():
    x, r, w = _data((1, 1536), torch.bfloat16, 10), _data((1, 1536), torch.bfloat16, 11), _weight(1536)
    dsnorm.rms_norm(x, w)
    with torch.no_grad(), _Recorder() as mode:
        dsnorm.rms_norm(x, w)
        dsnorm.fused_add_rms_norm(x, r, w)
        dsnorm.fused_add_rms_norm_(x, r, w)
    names = " ".join(mode.ops)
    assert "dsnorm.rms_norm" in names and "dsnorm.fused_add_rms_norm." in names
    assert "dsnorm.fused_add_rms_norm_" in names


def test_lane_steps_aside_for_function_modes():
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = _data((1, 1536), torch.bfloat16, 25), _weight(1536)
    dsnorm.rms_norm(x, w)
    with torch.no_grad(), Seen() as mode:
        y = dsnorm.rms_norm(x, w)
    assert any("dsnorm.rms_norm" in f for f in mode.funcs)
    assert bits_equal(y, rms_norm_ref(x, w))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda x, r, w: dsnorm.rms_norm(x, w, -1.0), ValueError),
        (lambda x, r, w: dsnorm.rms_norm(x, w, float("nan")), ValueError),
        (lambda x, r, w: dsnorm.rms_norm(x, w, cast="fast"), ValueError),
        (lambda x, r, w: dsnorm.fused_add_rms_norm(x, r, w, residual_rounding="nearest"), ValueError),
        (lambda x, r, w: dsnorm.fused_add_rms_norm(x.float(), r.float(), w, residual_rounding="round_first",
                                                   residual_dtype=torch.float32), ValueError),
        (lambda x, r, w: dsnorm.fused_add_rms_norm(x, r[:, :8], w), ValueError),
        (lambda x, r, w: dsnorm.fused_add_rms_norm(x, r.view(1, 1, 64), w), ValueError),
        (lambda x, r, w: dsnorm.fused_add_rms_norm_(x, x, w), ValueError),
        (lambda x, r, w: dsnorm.rms_norm(x, w[:8]), ValueError),
    ],
)
def test_lane_leaves_refusals_to_the_general_path(call, error):
    x, r, w = _data((1, 64), torch.bfloat16, 12), _data((1, 64), torch.bfloat16, 13), _weight(64)
    dsnorm.rms_norm(x, w)
    before = (x.clone(), r.clone())
    with torch.no_grad(), pytest.raises(error):
        call(x, r, w)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])


def test_module_call_runs_hooks():
    m = dsnorm.RMSNorm(64)
    x = _data((1, 64), torch.bfloat16, 14)
    calls = []
    with torch.no_grad():
        m(x)  # the lane is installed and warm
        h1 = m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        h2 = m.register_forward_hook(lambda mod, args, out: calls.append("post"))
        assert bits_equal(m(x), rms_norm_ref(x * 2, m.weight))
        assert calls == ["post"]
        h1.remove()
        h2.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: calls.append("global"))
        try:
            m(x)
        finally:
            handle.remove()
        assert calls == ["post", "global"]
        # keyword arguments go through nn.Module.__call__ to forward
        r = _data((1, 64), torch.bfloat16, 15)
        y, res = m(x, residual=r)
        y_ref, res_ref = fused_add_rms_norm_ref(x, r, m.weight)
        assert bits_equal(y, y_ref) and bits_equal(res, res_ref)


_FAULTS_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch, dsnorm
    shape = (64, 1, 7168)
    x = torch.full(shape, 0.5, dtype=torch.bfloat16)  # no fp32 temporaries (see below)
    r = torch.full(shape, 0.25, dtype=torch.bfloat16)
    w = torch.ones(7168)
    # glibc's state that made every call fault: one freed block of an output's size sets its
    # mmap threshold to that size and its trim threshold to twice that, which two outputs fill.
    torch.empty(x.numel() * 2, dtype=torch.uint8)
    with torch.no_grad():
        if sys.argv[1] == "large-first":  # a prefill-sized call before decoding
            big = torch.full((2400, 7168), 0.5, dtype=torch.bfloat16)
            dsnorm.fused_add_rms_norm(big, big.clone(), w)
        for _ in range(5):
            dsnorm.fused_add_rms_norm(x, r, w)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            dsnorm.fused_add_rms_norm(x, r, w)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
@pytest.mark.parametrize("history", ["fresh", "large-first"])
def test_fused_outputs_do_not_fault_every_call(history):
    # Two fresh 917 KB outputs a call; unprimed, glibc returned them to the OS on every call and
    # faulted them back in (416 page faults a call measured).
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, history], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 10


# ---------------------------------------------------------------------------------------------
# The MLA pair's lane (dsnorm.cpu.lane.mla_lane): the core decode kernel twice, same bits as the
# general path, and it steps aside for what that path exists for.


@pytest.fixture
def mla_lane_only(monkeypatch):
    """The MLA op's general implementation fails loudly: what still succeeds took the lane."""
    from dsnorm import fusions

    def general(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(fusions, "_mla_impl", general)
    monkeypatch.setattr(fusions, "_mla_op", general)


def _mla_inputs(lead, dtype, seed=40):
    return _data((*lead, 1536), dtype, seed), _data((*lead, 576), dtype, seed + 1), _weight(1536, seed + 2), \
        _weight(512, seed + 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (1, 1), (3, 2), (16,), (64, 1)])  # 16 and 64 rows: q on the thread pool
def test_mla_lane_matches_the_two_norms(mla_lane_only, dtype, lead):
    q, kv, wq, wkv = _mla_inputs(lead, dtype)
    kv_before = kv.clone()
    with torch.no_grad():
        qn, kvn = dsnorm.mla_latent_norms(q, kv, wq, wkv)
    assert qn.shape == q.shape and kvn.shape == (*lead, 512) and kvn.is_contiguous()
    assert bits_equal(qn, rms_norm_ref(q, wq)) and bits_equal(kvn, rms_norm_ref(kv[..., :512], wkv))
    assert torch.equal(kv, kv_before)


@pytest.mark.parametrize("case", ["strided q", "bf16 weight", "fp64", "grad", "dispatch mode", "large"])
def test_mla_lane_steps_aside(monkeypatch, case):
    from dsnorm import fusions
    from dsnorm.cpu import lane

    answers = []  # what the lane returned: None where it stepped aside
    monkeypatch.setattr(fusions, "_mla_lane", lambda *args: answers.append(lane.mla_lane(*args)) or answers[-1])
    q, kv, wq, wkv = _mla_inputs((2, 1), torch.bfloat16)
    if case == "strided q":
        q = _data((2, 1, 1600), torch.bfloat16, 50)[..., :1536]
    elif case == "bf16 weight":
        wq = wq.to(torch.bfloat16)
    elif case == "fp64":
        q, kv = q.double(), kv.double()
    elif case == "large":
        q, kv, wq, wkv = _mla_inputs((128,), torch.bfloat16)  # prefill-sized: the general path
    want = (rms_norm_ref(q, wq), rms_norm_ref(kv[..., :512], wkv))  # fp64: computed in fp64, as the reference's
    if case == "grad":
        with pytest.raises(RuntimeError, match="inference-only"):
            dsnorm.mla_latent_norms(q, kv, wq.requires_grad_(), wkv)
        assert len(answers) == 1 and answers[0] is None
        return
    with torch.no_grad():
        if case == "dispatch mode":
            with _Recorder() as mode:
                got = dsnorm.mla_latent_norms(q, kv, wq, wkv)
            assert any("dsnorm.mla_latent_norms" in name for name in mode.ops)
        else:
            got = dsnorm.mla_latent_norms(q, kv, wq, wkv)
    assert len(answers) == 1 and answers[0] is None  # the lane was asked and stepped aside
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
