"""vLLM's norms as ``dsnorm bench`` peers, where vLLM is installed, each with its fidelity against
vLLM's own definition (its ``native`` IR impls, eager, with the gains in the activations' dtype as
vLLM holds them):

* ``vLLM native``: that definition, eager (vLLM's CPU default);
* ``vLLM native compiled``: ``torch.compile`` of it with Inductor, as the CPU engine compiles it;
* ``vLLM C++``: the CPU extension vLLM would load on this host (``_C`` with AVX-512 BF16,
  ``_C_AVX512``, else ``_C_AVX2``: ``vllm.platforms.cpu``'s rule), the one ``--vllm-so`` names;
* ``dsnorm (vLLM provider)``: dsnorm's impls as the ``dsnorm`` provider serves them.

The fidelity is stated in each row's note: bitwise, or the share of elements that differ and the
largest difference in ulps.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from dsnorm.bench.cases import case_bytes
from dsnorm.bench.providers import InputPool, Runner, Unavailable, _const, find_vllm_so, vllm_host_build
from dsnorm.ref import EPS


def available() -> bool:
    """vLLM is installed (found without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _ir_ops():
    try:
        from vllm.ir import ops
    except Exception as e:  # an import of a foreign engine can fail in many ways
        raise Unavailable(f"vllm.ir not importable: {type(e).__name__}: {str(e)[:100]}")
    return ops


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ia, ib = a.contiguous().view(bits).to(torch.int64), b.contiguous().view(bits).to(torch.int64)
    sign = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + sign), ia)
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def fidelity(outputs: tuple, definition: tuple) -> str:
    """``outputs`` against ``definition`` (both ``(y, residual_out or None)``), in words."""
    words = []
    for name, got, want in zip(("y", "residual"), outputs, definition):
        if want is None:
            continue
        differ = (got.contiguous().view(torch.int16 if got.element_size() == 2 else torch.int32)
                  != want.contiguous().view(torch.int16 if want.element_size() == 2 else torch.int32))
        if not bool(differ.any()):
            words.append(f"{name} bitwise")
        else:
            words.append(f"{name} {100 * differ.float().mean().item():.3g}% differ, max {_ulps(got, want)} ulp")
    return "vs vLLM native: " + ", ".join(words)


def _definition(case, inp, w):
    ops = _ir_ops()
    if case.form == "plain":
        return ops.rms_norm.impls["native"].impl_fn(inp.x, w, EPS), None
    return ops.fused_add_rms_norm.impls["native"].impl_fn(inp.x, inp.residual, w, EPS)


def _runner(name, case, inp, plain_fn, fused_fn, note) -> Runner:
    """A functional peer ``plain_fn(x)`` / ``fused_fn(x, residual) -> (y, residual_out)`` with its
    fidelity against the definition in the note (in-place cases time the fused form on fresh
    copies, as vLLM's functional overload does)."""
    if case.backward:
        raise Unavailable("inference only")
    w = inp.gains.to(inp.x.dtype)
    want = _definition(case, inp, w)
    if case.form == "plain":
        got = (plain_fn(inp.x, w), None)
        fn = lambda x: plain_fn(x, w)  # noqa: E731
        args = _const(inp.x)
    else:
        got = fused_fn(inp.x.clone(), inp.residual.clone(), w)
        fn = lambda x, r: fused_fn(x, r, w)  # noqa: E731
        args = InputPool((inp.x, inp.residual)).next if case.form == "in-place" else _const(inp.x, inp.residual)
    note = "; ".join(p for p in (note, fidelity(got, want)) if p)
    return Runner(name, "peer", fn, args, lambda: got, nbytes=case_bytes(case), gains="input", note=note)


def _native():
    ops = _ir_ops()
    plain, fused = ops.rms_norm.impls["native"].impl_fn, ops.fused_add_rms_norm.impls["native"].impl_fn
    return (lambda x, w: plain(x, w, EPS)), (lambda x, r, w: fused(x, r, w, EPS))


def build_native(case, inp, ctx) -> Runner:
    plain, fused = _native()
    return _runner("vLLM native", case, inp, plain, fused, "eager, model-dtype weight")


def build_native_compiled(case, inp, ctx) -> Runner:
    if ctx.quick:
        raise Unavailable("skipped in --quick")
    plain, fused = _native()
    torch._dynamo.reset()
    return _runner("vLLM native compiled", case, inp, torch.compile(plain, dynamic=False, fullgraph=True),
                   torch.compile(fused, dynamic=False, fullgraph=True), "Inductor, as the CPU engine compiles")


def build_cpp(case, inp, ctx) -> Runner:
    if ctx.device.type != "cpu":
        raise Unavailable("vLLM's CPU extension runs on CPU only")
    which = vllm_host_build()
    cops = ctx.vllm_ops()  # the library the bench loaded (--vllm-so, $DSNORM_VLLM_SO or vLLM's)
    loaded = os.path.basename(find_vllm_so(getattr(ctx, "_vllm_so", None))[0] or "")
    note = f"vLLM loads {which} here" + ("" if loaded.startswith(which + ".") else f"; this is {loaded}")

    def plain(x, w):
        x = x.contiguous()  # the kernel ignores row strides
        out = torch.empty(x.shape, dtype=x.dtype)
        cops.rms_norm(out, x, w, EPS)
        return out

    def fused(x, r, w):
        cops.fused_add_rms_norm(x, r, w, EPS)
        return x, r

    return _runner("vLLM C++", case, inp, plain, fused, note)


def build_provider(case, inp, ctx) -> Runner:
    from dsnorm.integrations import vllm as provider

    return _runner("dsnorm (vLLM provider)", case, inp, lambda x, w: provider.rms_norm(x, w, EPS),
                   lambda x, r, w: provider.fused_add_rms_norm(x, r, w, EPS), "model-dtype weight")


def peers() -> tuple:
    """``(name, builder)`` pairs for ``dsnorm.bench.registry.PROVIDERS``: empty without vLLM."""
    if not available():
        return ()
    return (("vLLM native", build_native), ("vLLM native compiled", build_native_compiled),
            ("vLLM C++", build_cpp), ("dsnorm (vLLM provider)", build_provider))
