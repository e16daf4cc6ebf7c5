"""Replace the RMSNorm modules of a model with ``dsnorm.RMSNorm``, keeping its numerics bit for bit.

``y = weight * x / sqrt(mean(x^2) + eps)`` is computed by every RMSNorm family in float32, but they
differ in where the result is rounded, and that decides the ``cast`` mode dsnorm must use:

* the DeepSeek reference ``RMSNorm`` (float32 weight) and ``torch.nn.RMSNorm`` on CPU
  (``F.rms_norm`` multiplies the float32 x̂ by the weight in float32, then casts once) are
  ``cast="deepseek"``: ``(weight * xhat).to(x.dtype)``;
* Hugging Face ``DeepseekV3RMSNorm`` and the Llama-style norms (``variance_epsilon``) compute
  ``weight * xhat.to(x.dtype)``: with a weight in the activations' dtype (a bf16 model) that is
  ``cast="hf"``: ``weight.to(x.dtype) * xhat.to(x.dtype)``.

The weight is copied exactly (bf16/fp16 widen to float32 without rounding) and eps is read from the
module. Norms dsnorm cannot reproduce are left in place and reported: Gemma-style ``(1 + weight)``
gains, norms without a weight, multi-dimensional normalised shapes, ``torch.nn.RMSNorm`` off CPU (a
fused kernel of its own order), unknown implementations. Each replacement is also checked on probe
inputs against the module it replaces, and left alone if any output bit differs (on CPU copies for a
model on a GPU, where dsnorm's guarantee is one ulp, not bits).

"Bit for bit" covers bf16, fp16 and fp32 activations (the probe's). fp64 activations differ:
dsnorm computes them in fp64 (its one departure from the reference), where the reference and
Hugging Face narrow x̂ to fp32 (a patched model run in fp64 is more accurate, not bitwise the
same); and a ``torch.nn.RMSNorm(eps=None)`` is given float32's machine epsilon, which torch uses for
every input dtype but fp64 (float64's, ~1e-16: rows of tiny values then differ widely).
"""

from __future__ import annotations

import copy
import inspect
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, SupportsIndex, Union

import torch
from torch import nn

from dsnorm.autograd import fused_add_rms_norm, rms_norm
from dsnorm.module import RMSNorm
from dsnorm.ops import EPS_MAX, EPS_MIN, _as_float
from dsnorm.ref import EPS
from dsnorm.terminal import wrap

# Activation dtypes dsnorm and the norms it replaces share; the weight must widen to fp32 exactly.
_EXACT_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_RMS_LIKE = re.compile(r"rms_?norm", re.IGNORECASE)


@dataclass
class PatchEntry:
    """One RMSNorm-like module: what :func:`patch` did with it and why.

    Attributes:
        name: module path in the model (``""`` for the root).
        cls: the original class name.
        replaced: True when it is now a ``dsnorm.RMSNorm``.
        cast: the dsnorm ``cast`` chosen (``None`` when left alone).
        eps: the eps read from the module (``None`` when left alone).
        reason: why it was replaced with that cast, or why it was left alone.
    """

    name: str
    cls: str
    replaced: bool
    reason: str
    cast: Optional[str] = None
    eps: Optional[float] = None
    dim: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PatchReport:
    """Result of :func:`patch`: ``replaced`` and ``left`` entries (:class:`PatchEntry`)."""

    replaced: list[PatchEntry] = field(default_factory=list)
    left: list[PatchEntry] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"replaced": [e.to_dict() for e in self.replaced], "left": [e.to_dict() for e in self.left]}

    def format(self, detail: bool = False) -> str:
        """The report as text. A count line, then one paragraph per group of modules that share a
        class, an outcome (cast) and an explanation: how many, their dims and eps, the explanation,
        and their names with layer indices folded (``model.layers.{0-60}.input_layernorm``), wrapped
        to ``terminal.COLUMNS``. ``detail``: one line per module instead."""
        lines = [f"replaced {len(self.replaced)} norm(s), left {len(self.left)}"]
        if detail:
            lines += [f"  replaced {e.name or '<root>'} ({e.cls}, dim {e.dim}, eps {e.eps:g}) with cast={e.cast!r}: "
                      f"{e.reason}" for e in self.replaced]
            lines += [f"  left {e.name or '<root>'} ({e.cls}): {e.reason}" for e in self.left]
            return "\n".join(lines)
        groups: dict = {}
        for e in self.replaced + self.left:
            groups.setdefault((e.replaced, e.cls, e.cast, e.reason), []).append(e)
        for (replaced, cls, cast, reason), entries in groups.items():
            n = len(entries)
            if replaced:
                dims = ", ".join(str(d) for d in sorted({e.dim for e in entries}))
                eps = ", ".join(f"{x:g}" for x in sorted({e.eps for e in entries}))
                head = (f"replaced {n} {cls} (dim{'s' if ',' in dims else ''} {dims}; eps {eps}) with "
                        f"cast={cast!r}: {reason}")
            else:
                head = f"left {n} {cls}: {reason}"
            lines += wrap(head, "    ", indent="  ")
            lines += wrap("modules: " + ", ".join(_fold_names([e.name or "<root>" for e in entries])), "      ",
                          indent="    ")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _fold_names(names: list) -> list:
    """Module names with their first numeric component folded: ``a.layers.0.b``, ``a.layers.1.b``
    and ``a.layers.3.b`` become ``a.layers.{0-1,3}.b``; first-seen order."""
    folded: dict = {}
    for name in names:
        m = re.search(r"(?:^|(?<=\.))(\d+)(?=\.|$)", name)
        key = name if m is None else name[:m.start()] + "{}" + name[m.end():]
        folded.setdefault(key, []).append(None if m is None else int(m.group(1)))
    out = []
    for key, indices in folded.items():
        if indices == [None] or len(indices) == 1:
            out.append(key if indices == [None] else key.replace("{}", str(indices[0]), 1))
            continue
        runs, nums = [], sorted(set(indices))
        start = prev = nums[0]
        for i in nums[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        out.append(key.replace("{}", "{" + ",".join(runs) + "}", 1))
    return out


class _Leave(Exception):
    pass


def _weight_1d(module: nn.Module) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if w is None:
        raise _Leave("no weight (nothing to keep; dsnorm always has a gain)")
    if not isinstance(w, torch.Tensor):
        raise _Leave(f"weight is a {type(w).__name__}, not a tensor")
    if isinstance(w, nn.parameter.UninitializedTensorMixin):  # a lazy module's: no shape or values yet
        raise _Leave("weight is uninitialised (a lazy module): run a forward or materialise it first, then patch")
    if w.dim() != 1:
        raise _Leave(f"weight is {w.dim()}-D {list(w.shape)}: dsnorm normalises over the last axis only")
    if w.shape[0] == 0:
        raise _Leave("weight is empty (width 0): dsnorm normalises rows of at least one element")
    if w.is_meta:
        raise _Leave("weight is on the meta device (no values to keep or check): materialise the model "
                     "first (model.to_empty(device=...)), then patch, then load_norms")
    if w.dtype not in _EXACT_WEIGHT_DTYPES:
        raise _Leave(f"weight is {w.dtype}: only bf16/fp16/fp32 gains are kept exactly in dsnorm's fp32 weight")
    return w


def _eps(value, what: str) -> float:
    # Any real number the module may hold (numpy scalars included, as dsnorm's own eps accepts);
    # one dsnorm cannot take leaves the norm with the reason (an int past float's range too).
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Leave(f"{what} is {value!r}, not a number")
    if not EPS_MIN <= _as_float(value) <= EPS_MAX:
        raise _Leave(f"{what} is {value!r}: dsnorm takes eps > 0 with a nonzero finite float32 rounding")
    return float(value)


def _forward_params(module: nn.Module) -> Optional[list]:
    """The names ``forward`` takes after ``self`` (``*args`` / ``**kwargs`` as ``*name`` / ``**name``),
    or None when its signature cannot be read."""
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return None
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [prefix.get(p.kind, "") + p.name for p in params][1:]


def _takes_only(module: nn.Module, count: int) -> None:
    """Leave a norm whose forward takes more than its first ``count`` arguments: dsnorm's second
    one is the residual, so a gate (Mamba2 / Bamba / Qwen3-Next gated norms) would silently become one."""
    params = _forward_params(module)
    if params is None:
        raise _Leave("forward's signature cannot be read")
    if len(params) > count or any(p.startswith("*") for p in params):
        raise _Leave(f"forward takes {', '.join(params)}: more than dsnorm's "
                     f"{'(x)' if count == 1 else '(x, residual)'}")


# What nn.Module keeps per instance that a replacement would silently drop.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
    "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def _check_replaceable(module: nn.Module) -> None:
    """Leave a module carrying per-instance behaviour dsnorm.RMSNorm would not: hooks (activation
    capture, offloading), a forward replaced on the instance (accelerate's hook wrapper), a
    parametrised weight (whose value a copy would freeze)."""
    hooks = [h for h in _HOOK_DICTS if getattr(module, h, None)]
    if hooks:
        raise _Leave(f"has hooks ({', '.join(hooks)}) that a replacement would drop")
    if "forward" in module.__dict__:
        raise _Leave("forward is replaced on the instance (a hook wrapper, e.g. accelerate's offload): "
                     "a replacement would drop it")
    if torch.nn.utils.parametrize.is_parametrized(module):
        raise _Leave("weight is parametrised (torch.nn.utils.parametrize): a copy would freeze its value")


class PromotingHFRMSNorm(RMSNorm):
    """A Hugging Face / Llama-style norm: ``weight * x̂.to(x.dtype)`` with torch's type promotion
    between the gain's dtype and ``x``'s, ``x̂ = x * rsqrt(mean(x^2) + eps)`` in fp32.

    Where the promotion changes nothing (``x`` in the gain's dtype or a wider one) that is
    ``cast="hf"`` (one kernel, and RMSNorm's fast lane). Otherwise HF returns the promoted product,
    which no single dsnorm cast gives: for bf16/fp16 ``x`` with an fp32 gain (an fp32 model under
    autocast, fp32 master weights) the fp32 product of the gain and the rounded x̂, and likewise
    fp32 for fp16 ``x`` with a bf16 gain or bf16 ``x`` with an fp16 gain. x̂ is then rounded once
    by a unit-gain dsnorm norm and multiplied by the gain in the gain's dtype, as HF does.

    The gain's dtype is the weight's own when that is not fp32 (after ``.to(torch.bfloat16)`` or a
    mixed-precision wrapper's cast, as HF's gain would be), else ``gain_dtype``: the dtype of the
    gain the fp32 weight stands for, which follows the module's casts (``.half()``, ``.float()``).
    Where the weight is HF's own fp32 Parameter (``gain_is_weight``, as :func:`patch` keeps it),
    the gain is the weight in whatever dtype it holds, as HF's is.
    The gain is the weight rounded to that dtype, as HF's parameter would hold it (an fp32 value
    copied in by ``load_state_dict`` is rounded where it is used, not where it is stored, so a
    model reloading its own state_dict is unchanged; :func:`dsnorm.load_norms` refuses such
    values). :func:`patch` uses this class for HF norms; the weight (fp32 as patched), state_dict
    key and the other arguments are ``RMSNorm``'s, with ``cast="hf"``.
    """

    gain_dtype = torch.float32  # also for modules pickled before gain_dtype existed (fp32 gains only)
    # True where the weight is HF's own fp32 Parameter (patch keeps it): the gain is the weight as it
    # is, in whatever dtype it holds, as HF's is; gain_dtype then stays float32 and follows no cast,
    # so a cast that reaches the shared Parameter some other way (another owner) leaves nothing stale.
    gain_is_weight = False

    def __init__(
        self, dim: SupportsIndex, eps: float = EPS, *, gain_dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> None:
        if gain_dtype not in _GAIN_DTYPES:
            raise ValueError(f"gain_dtype must be a floating dtype of {_GAIN_DTYPES}, got {gain_dtype}")
        if kwargs.setdefault("cast", "hf") != "hf":
            raise ValueError(f"cast must be 'hf' for PromotingHFRMSNorm (HF's order), got {kwargs['cast']!r}")
        super().__init__(dim, eps, **kwargs)
        self.gain_dtype: torch.dtype = gain_dtype

    def _gain_dtype(self) -> torch.dtype:
        """The dtype HF's gain would have here (see the class docstring)."""
        return _gain_dtype(self._parameters.get("weight"), self.gain_dtype)

    def _lane_takes(self, args) -> bool:
        # The calls whose result is RMSNorm's with the module's own weight (not in a further
        # subclass): x of the gain's dtype (cast="hf" rounds the weight to it), or, when the weight
        # is exactly the gain, x the gain does not promote (always, in the fused form).
        if type(self).forward is not PromotingHFRMSNorm.forward:
            return False
        x, weight = args[0], self._parameters.get("weight")
        if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
            return False
        gain = _gain_dtype(weight, self.gain_dtype)
        if x.dtype is not gain and weight.dtype is not gain:
            return False
        return (len(args) == 2 and args[1] is not None) or x.dtype in _UNPROMOTED[gain]

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is not None:
            # HF has no fused form: it is RMSNorm's (cast="hf", no promotion), with the same gain.
            weight = self.weight
            if isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor):
                weight, _ = _gain(x, weight, self.gain_dtype)
            return fused_add_rms_norm(x, residual, weight, self.eps, cast=self.cast,
                                      residual_rounding=self.residual_rounding, residual_dtype=self.residual_dtype)
        # The weight as the call sees it (a wrapper may have swapped it) decides the gain's dtype
        # inside the function, so an FX graph traced here follows later casts that change the
        # weight's dtype (not .float() of a narrower gain: the traced gain_dtype is a constant).
        return _promoted_hf_norm(x, self.weight, self.eps, self.gain_dtype)

    def _apply(self, fn, recurse=True):
        # What this cast does to a tensor of the gain's dtype is what it would do to HF's gain. A
        # caller's fn that takes only its own tensors may refuse the probe; the weight's dtype then
        # still says what a dtype cast did (_gain_dtype).
        if self.gain_is_weight:
            return super()._apply(fn, recurse)
        weight = self._parameters.get("weight")
        try:
            gain = fn(torch.empty(0, dtype=self.gain_dtype, device="cpu" if weight is None else weight.device)).dtype
        except (RuntimeError, TypeError, ValueError, AssertionError):  # AssertionError: .cuda() without CUDA
            gain = None
        if (gain is not None and gain is not self.gain_dtype and self.gain_dtype in (torch.bfloat16, torch.float16)
                and isinstance(weight, torch.Tensor) and weight.dtype is torch.float32):
            with torch.no_grad():  # HF's narrower parameter holds the rounded values it casts from
                weight.copy_(weight.to(self.gain_dtype))
        out = super()._apply(fn, recurse)
        if gain in _GAIN_DTYPES:
            self.gain_dtype = gain
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gain_dtype={self.gain_dtype}"


_GAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# For each gain dtype, the activation dtypes its product leaves in their own dtype (no promotion):
# those take RMSNorm's forward with cast="hf" (fp64 is computed in fp64, dsnorm's departure).
_UNPROMOTED = {g: frozenset(d for d in _GAIN_DTYPES if torch.promote_types(g, d) == d) for g in _GAIN_DTYPES}


def _gain_dtype(weight, gain_dtype: torch.dtype) -> torch.dtype:
    if isinstance(weight, torch.Tensor) and weight.dtype is not torch.float32 and weight.dtype in _UNPROMOTED:
        return weight.dtype
    return gain_dtype


def _gain(x: torch.Tensor, weight: torch.Tensor, gain_dtype: torch.dtype) -> tuple:
    """``(gain, its dtype)`` for a call on ``x``: the weight as HF's parameter holds it, rounded to
    the gain's dtype (for x of that dtype cast="hf" rounds it anyway, so it is passed as it is)."""
    gain_dtype = _gain_dtype(weight, gain_dtype)
    return (weight if x.dtype is gain_dtype else weight.to(gain_dtype)), gain_dtype


def _promoted_hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gain_dtype: torch.dtype) -> torch.Tensor:
    """HF's ``weight * x̂.to(x.dtype)`` with torch's promotion, the gain in the weight's dtype, or in
    ``gain_dtype`` when the weight is fp32 (see PromotingHFRMSNorm).

    Args:
        x: ``[..., n]`` float32 / bfloat16 / float16 / float64.
        weight: ``[n]`` the gain's values.
        eps: as :func:`dsnorm.rms_norm`.
        gain_dtype: a key of ``_UNPROMOTED``.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return rms_norm(x, weight, eps, cast="hf")  # which names the argument that is not a tensor
    weight, gain_dtype = _gain(x, weight, gain_dtype)
    if x.dtype in _UNPROMOTED[gain_dtype]:
        return rms_norm(x, weight, eps, cast="hf")
    unit = torch.ones(weight.shape[-1], dtype=torch.float32, device=weight.device)
    return weight * rms_norm(x, unit, eps, cast="hf")


# torch.fx.symbolic_trace records it as a node (the dtype test cannot take a Proxy), as module.py
# does for the norms themselves.
torch.fx.wrap("_promoted_hf_norm")


@dataclass
class _Candidate:
    """One way to reproduce a norm: the dsnorm class and cast, the activation dtypes to probe in."""

    cls: type
    cast: str
    dtypes: list
    reason: str
    kwargs: dict = field(default_factory=dict)  # more constructor arguments (PromotingHFRMSNorm's gain_dtype)


def _plan(module: nn.Module) -> tuple:
    """``(eps, fused_probe, candidates)`` for a norm dsnorm may reproduce (the first candidate that
    passes the probe is taken); raises ``_Leave`` otherwise."""
    cls = type(module).__name__
    _check_replaceable(module)
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            raise _Leave(f"normalized_shape {tuple(module.normalized_shape)} spans several axes")
        w = _weight_1d(module)
        if w.device.type != "cpu":
            # Off CPU F.rms_norm may dispatch to a fused kernel whose reduction order dsnorm does not claim.
            raise _Leave(f"torch.nn.RMSNorm on {w.device.type}: F.rms_norm uses its own fused kernel there; "
                         "bitwise equality is established on CPU only")
        # eps=None means float32's machine epsilon for bf16/fp16/fp32 inputs (F.rms_norm's opmath type).
        eps = torch.finfo(torch.float32).eps if module.eps is None else _eps(module.eps, "eps")
        dtypes = sorted({w.dtype, torch.bfloat16, torch.float32}, key=str)
        return eps, False, [_Candidate(RMSNorm, "deepseek", dtypes,
                                       "torch.nn.RMSNorm on CPU: F.rms_norm multiplies the fp32 x̂ by the weight "
                                       "in fp32, casts once")]
    if "gemma" in cls.lower():
        raise _Leave("Gemma-style norm: gain is (1 + weight), not weight")
    if hasattr(module, "variance_epsilon") and _RMS_LIKE.search(cls):
        _takes_only(module, 1)
        w = _weight_1d(module)
        eps = _eps(module.variance_epsilon, "variance_epsilon")
        # Most such classes compute weight * x̂.to(x.dtype) (DeepseekV3, Llama, Qwen, Mistral); some
        # (Olmo2, GptOss) (weight * x̂).to(x.dtype): the probe, with a non-unit gain, tells them apart.
        deepseek_order = "Llama-style class whose probe matches (weight * x̂) in fp32, cast once"
        # HF promotes the gain with activations of another dtype: an fp32 gain meets bf16/fp16
        # activations under autocast (fp32 out), a bf16 gain fp16 ones under an fp16 autocast (fp32
        # out). Probed in all three dtypes (_weight_1d admits only these gains).
        dtypes = [w.dtype] + [d for d in (torch.float32, torch.bfloat16, torch.float16) if d != w.dtype]
        return eps, False, [
            _Candidate(PromotingHFRMSNorm, "hf", dtypes,
                       f"Hugging Face / Llama-style, {str(w.dtype)[6:]} weight: weight * x̂.to(x.dtype), promoted "
                       "(fp32 for activations of another dtype)", {"gain_dtype": w.dtype}),
            _Candidate(RMSNorm, "deepseek", dtypes, deepseek_order),
        ]
    if (cls in ("RMSNorm", "RMSNormRef") and hasattr(module, "eps") and hasattr(module, "dim")
            and "residual" in (_forward_params(module) or ())):
        _takes_only(module, 2)
        w = _weight_1d(module)
        eps = _eps(module.eps, "eps")
        if w.shape[0] != module.dim:
            raise _Leave(f"weight has {w.shape[0]} elements but dim is {module.dim}")
        return eps, True, [_Candidate(RMSNorm, "deepseek", [torch.bfloat16, torch.float32],
                                      "DeepSeek reference RMSNorm: (weight * x̂) in fp32, cast once; fused "
                                      "residual form kept")]
    raise _Leave(f"unrecognised RMSNorm implementation {cls}: not known to be reproducible bitwise")


def _same(a, b) -> bool:
    """Equal dtypes, shapes and values, with NaN in the same places: ``torch.equal`` counts NaN as
    unequal, and a gain holding NaN or inf (uninitialised memory after ``to_empty``, before the
    checkpoint is loaded) would then look like a difference that dsnorm does not make."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _probe(old: nn.Module, new: RMSNorm, dtypes: list, fused: bool) -> Optional[str]:
    """Run both modules on a few fixed inputs, with their own gain and then (on copies) with a
    random one; the first difference found, or ``None``.

    The second gain matters: a norm patched before its weights are loaded has a gain of ones, under
    which ``weight * x̂.to(dtype)`` and ``(weight * x̂).to(dtype)`` agree bit for bit.

    Modules off the CPU are probed as CPU copies. Bit for bit is a CPU property: on a GPU the module's
    own mean and dsnorm's kernel each sum in an order of their own (dsnorm's within one ulp of the
    reference there), so an fp32 probe on the device would differ in nearly every row and leave every
    norm in place. What the probe decides, the formula and where it rounds, is the module's code,
    the same on every device.
    """
    if new.weight.device.type != "cpu":
        old, new = copy.deepcopy(old).to("cpu"), copy.deepcopy(new).to("cpu")
    gen = torch.Generator().manual_seed(0x5EED)
    dim = new.dim
    device = new.weight.device
    base = torch.randn(6, dim, generator=gen)
    # Rows of very different magnitudes and one all-zero row exercise eps and the rounding.
    base = base * torch.tensor([1.0, 1e-3, 30.0, 1.0, 1e2, 0.0]).unsqueeze(1)
    res = torch.randn(6, dim, generator=gen)
    gain = 1 + 0.5 * torch.randn(dim, generator=gen)
    old_gained, new_gained = copy.deepcopy(old), copy.deepcopy(new)
    with torch.no_grad():
        old_gained.weight.copy_(gain.to(old.weight.dtype))
        new_gained.weight.copy_(old_gained.weight.to(torch.float32))  # exact: bf16/fp16 widen
    # F.rms_norm warns when input and weight dtypes differ; the probe does that on purpose.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for gained, (a_mod, b_mod) in enumerate(((old, new), (old_gained, new_gained))):
            what = " with a random gain" if gained else ""
            for dtype in dtypes:
                x = base.to(device=device, dtype=dtype)
                a, b = a_mod.forward(x), b_mod(x)
                if not _same(a, b):
                    return f"probe in {dtype}{what}: output differs from dsnorm cast={new.cast!r}"
                if fused:
                    r = res.to(device=device, dtype=dtype)
                    fa, fb = a_mod.forward(x, r), b_mod(x, r)
                    if not (isinstance(fa, tuple) and len(fa) == 2 and all(_same(p, q) for p, q in zip(fa, fb))):
                        return f"probe in {dtype}{what} with residual: output differs from dsnorm cast={new.cast!r}"
    return None


def patch(model: nn.Module, *, probe: bool = True) -> PatchReport:
    """Replace, in place, every RMSNorm-like module of ``model`` with a ``dsnorm.RMSNorm`` of the same numerics.

    ``y = weight * x / sqrt(mean(x^2) + eps)``: the reference ``RMSNorm`` and ``torch.nn.RMSNorm`` (CPU)
    become ``cast="deepseek"``, Hugging Face ``DeepseekV3RMSNorm`` / Llama-style norms ``cast="hf"``
    (with a float32, bf16 or fp16 weight a :class:`PromotingHFRMSNorm`, which also returns HF's
    promoted fp32 result for inputs of another 16-bit dtype; Llama-style classes of the other order,
    found by the probe, ``"deepseek"``);
    a float32 weight ``Parameter`` becomes the new module's ``weight`` itself (the same object, so
    an optimizer, DDP or EMA built before the patch still updates it), any other 1-D weight is
    copied exactly into dsnorm's float32 ``weight[dim]`` on the same device, with its
    ``requires_grad`` (a new Parameter: optimizers built before the patch must be rebuilt); eps is
    read from the module. A module shared under several names is replaced by one shared dsnorm
    module, a gain tied between modules by one shared parameter.
    Modules with hooks, a forward replaced on the instance, a parametrised weight or a forward that
    takes more than dsnorm's ``(x[, residual])`` (gated norms) are left alone.

    Args:
        model: an ``nn.Module``; its children are replaced, the root itself never.
        probe: check every replacement bitwise on fixed probe inputs in the dtypes it will see
            (bf16 and fp32 for the reference class, those and the weight's dtype for
            torch.nn.RMSNorm, bf16, fp16 and fp32 for HF norms), with the module's own gain and a
            random one, and leave the module alone on any difference. A module on a GPU is probed
            as a CPU copy (bitwise is the CPU's guarantee; on a GPU dsnorm is within one ulp).
            ``False`` trusts the class alone (and takes the first cast it suggests).

    Returns:
        :class:`PatchReport`: what was replaced (with cast and eps) and what was left alone and why
        (Gemma-style ``(1 + w)`` gains, no weight, multi-dimensional shapes, unknown classes, ...).

    Modules are replaced only once every one has been planned and probed, so an error on the way
    leaves the model as it was.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    done: dict = {}  # id(original module) -> (its replacement, why)
    gains: dict = {}  # id(original weight) -> the replacement's weight Parameter
    replacements: list = []  # (name, new module), made once the whole model is planned
    # Snapshot first: replacing children while iterating named_modules would skip or revisit modules.
    candidates = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
                  if isinstance(m, nn.RMSNorm) or _RMS_LIKE.search(type(m).__name__)]
    for name, old in candidates:
        cls = type(old).__name__
        if isinstance(old, RMSNorm):
            report.left.append(PatchEntry(name, cls, False, "already a dsnorm.RMSNorm"))
            continue
        if name == "":
            report.left.append(PatchEntry(name, cls, False, "the root module cannot be replaced in place"))
            continue
        new, why = done.get(id(old), (None, ""))
        if new is None:
            try:
                eps, fused, options = _plan(old)
            except _Leave as e:
                report.left.append(PatchEntry(name, cls, False, str(e)))
                continue
            w = old.weight
            diffs = []
            for option in options if probe else options[:1]:
                new = option.cls(w.shape[0], eps, cast=option.cast, device=w.device, **option.kwargs)
                if isinstance(w, nn.Parameter) and w.dtype is torch.float32:
                    # The same Parameter: an optimizer, DDP or a tied module holding it before the
                    # patch still sees (and trains) the gain; a copy would leave them a dead one.
                    new.weight = w
                    if isinstance(new, PromotingHFRMSNorm):
                        new.gain_is_weight = True
                else:
                    with torch.no_grad():
                        new.weight.copy_(w.detach().to(torch.float32))
                    new.weight.requires_grad_(w.requires_grad)
                new.train(old.training)
                if probe:
                    try:
                        diff = _probe(old, new, option.dtypes, fused)
                    except Exception as e:  # the module under test may reject the probe input: then it stays
                        diff = f"probe failed: {type(e).__name__}: {e}"
                    if diff is not None:
                        diffs.append(diff)
                        new = None
                        continue
                why = option.reason
                if probe and w.device.type != "cpu":
                    why += (f"; probed bitwise on CPU copies (on {w.device.type} dsnorm's kernels are within one "
                            "ulp of the formula)")
                if new.weight is not w and isinstance(w, nn.Parameter):
                    why += (f"; its {str(w.dtype)[6:]} weight copied into a new float32 Parameter (an optimizer, "
                            "DDP or EMA built before the patch holds the old one, which the model no longer uses)")
                break
            if new is None:
                report.left.append(PatchEntry(name, cls, False, "; ".join(diffs)))
                continue
            # A gain tied between several norm modules stays one parameter (training updates it once).
            shared = gains.get(id(w))
            if shared is not None:
                new.weight = shared
            else:
                gains[id(w)] = new.weight
            done[id(old)] = (new, why)
        replacements.append((name, new))
        report.replaced.append(PatchEntry(name, cls, True, why, new.cast, new.eps, new.dim))
    # Only now, every module planned and probed: an error on the way leaves the model as it was.
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return report
