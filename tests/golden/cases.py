"""The golden set's recipe space, and the code that runs one recipe through dsnorm's public API.

A recipe is plain JSON: which call (``api``), how to build each input tensor (shape, dtype, layout
and a fill drawn from ``numpy.random.Generator(PCG64(seed))`` or from explicit bit patterns, so
every machine builds the same bits), the options, and the grad mode. Running it gives a result:
the outputs (shape, dtype, strides and a sha256 of their raw bytes) and whether the inputs were
left as they were, or the exception's type and message and whether the inputs were left as they
were. ``golden.json`` stores both; ``tests/test_golden.py`` re-runs every recipe and compares.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import re

import numpy as np
import torch

import dsnorm

DTYPES = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
    "int32": torch.int32, "fp8": torch.float8_e4m3fn, "c64": torch.complex64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_INT_OF = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32, torch.float64: np.uint64}
_MANT_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


# ---------------------------------------------------------------------------------------------
# Inputs.


def _special_values(dtype: torch.dtype) -> list:
    fi = torch.finfo(dtype)
    return [0.0, -0.0, float("inf"), float("-inf"), float("nan"), fi.smallest_normal, -fi.tiny,
            fi.smallest_normal * 2.0**-3, -fi.smallest_normal * 2.0**-(_MANT_BITS[dtype] - 1), fi.max, -fi.max,
            1.0, -1.0]


def _values(fill: str, count: int, dtype: torch.dtype, rng: np.random.Generator, scale: float) -> torch.Tensor:
    """``count`` values of ``dtype`` as a flat CPU tensor, from the rng or fixed patterns only."""
    wide = np.float64 if dtype == torch.float64 else np.float32
    if not dtype.is_floating_point or dtype.itemsize == 1:
        # Bad-argument dtypes: small integers, converted by torch (exact).
        return torch.from_numpy(rng.integers(-3, 4, count).astype(np.float32)).to(dtype)
    if fill in ("randbits", "subnormal"):
        kind = _INT_OF[dtype]
        bits = rng.integers(0, np.iinfo(kind).max, count, dtype=kind, endpoint=True)
        if fill == "subnormal":  # keep the sign bit and a mantissa: exponent field zero
            sign = kind(1) << kind(8 * np.dtype(kind).itemsize - 1)
            bits = (bits & (sign | kind((1 << _MANT_BITS[dtype]) - 1))).astype(kind)
        signed = {np.uint16: torch.int16, np.uint32: torch.int32, np.uint64: torch.int64}[kind]
        return torch.from_numpy(bits.view(np.dtype(kind).str.replace("u", "i"))).to(signed).view(dtype)
    if fill == "ones":
        v = np.ones(count, wide)
    elif fill == "zeros":
        v = np.zeros(count, wide)
    elif fill == "negzeros":
        v = -np.zeros(count, wide)
    elif fill == "arange":  # small exact values, for lengths and readable cases
        v = np.arange(count, dtype=wide)
    else:
        with np.errstate(over="ignore"):  # huge rows: values past the dtype's range become inf
            v = (rng.standard_normal(count) * scale).astype(wide)
    t = torch.from_numpy(v).to(dtype)  # fp32 -> bf16/fp16: one round to nearest even
    if fill == "special":  # a quarter of the elements replaced by special values
        specials = torch.tensor(_special_values(dtype), dtype=torch.float64).to(dtype)
        where = rng.random(count) < 0.25
        pick = rng.integers(0, len(specials), count)
        t[torch.from_numpy(where)] = specials[torch.from_numpy(pick)][torch.from_numpy(where)]
    elif fill in ("nanrow", "infrow") and count:  # one special element in an otherwise normal row
        t[int(rng.integers(0, max(count, 1)))] = float("nan") if fill == "nanrow" else float("inf")
    return t


def make(spec):
    """The tensor a spec describes. ``layout``: ``contig``; ``pad:P`` / ``off:P`` (rows of a wider
    buffer: the first n, or n from column P: strided rows); ``t`` (the last two dims transposed:
    not unit-stride along the row); ``expand`` (one row broadcast: rows share memory); ``gap``
    (leading dims that do not collapse to one row stride); ``meta`` (on the meta device);
    ``sparse``; ``inference`` (made under inference mode). ``{"values": [...]}``: an int64 vector."""
    if isinstance(spec, dict) and "values" in spec:  # an explicit int64 vector (final_norm's lengths)
        return torch.tensor(spec["values"], dtype=torch.int64)
    if not isinstance(spec, dict) or "shape" not in spec:
        return decode(spec)
    dtype = DTYPES[spec.get("dtype", "fp32")]
    shape = list(spec["shape"])
    layout = spec.get("layout", "contig")
    rng = np.random.Generator(np.random.PCG64(spec.get("seed", 0)))
    fill, scale = spec.get("fill", "normal"), spec.get("scale", 1.0)
    if layout.startswith(("pad:", "off:")):
        p = int(layout.split(":")[1])
        base_shape = shape[:-1] + [shape[-1] + p]
    elif layout == "t":
        base_shape = shape[:-2] + [shape[-1], shape[-2]]
    elif layout == "expand":
        base_shape = [1] * (len(shape) - 1) + shape[-1:]
    elif layout == "gap":
        base_shape = shape[:-2] + [shape[-2] + 1, shape[-1]]
    else:
        base_shape = shape
    count = int(np.prod(base_shape)) if base_shape else 1
    base = _values(fill, count, dtype, rng, scale).reshape(base_shape)
    if layout.startswith("pad:"):
        t = base[..., : shape[-1]]
    elif layout.startswith("off:"):
        t = base[..., -shape[-1]:] if shape[-1] else base[..., :0]
    elif layout == "t":
        t = base.transpose(-1, -2)
    elif layout == "expand":
        t = base.expand(shape)
    elif layout == "gap":
        t = base[..., : shape[-2], :]
    elif layout == "meta":
        t = base.to("meta")
    elif layout == "sparse":
        t = base.to_sparse()
    elif layout == "inference":
        with torch.inference_mode():
            t = base.clone()
    else:
        t = base
    if spec.get("param"):
        t = torch.nn.Parameter(t, requires_grad=False)
    if spec.get("requires_grad"):
        t = t.detach().requires_grad_()  # a leaf with the layout's strides
    return t


def decode(value):
    """JSON stand-ins for Python values a call may take: ``{"dtype": name}``, ``{"float": "nan"}``,
    ``{"np16": v}`` (a numpy float16), ``{"list": [...]}``; anything else as it is."""
    if isinstance(value, dict):
        if "dtype" in value and len(value) == 1:
            return DTYPES[value["dtype"]]
        if "float" in value:
            return float(value["float"])
        if "np16" in value:
            return np.float16(value["np16"])
    return value


# ---------------------------------------------------------------------------------------------
# Outputs.


def digest(t) -> dict:
    """Shape, dtype, strides and a sha256 (16 hex digits) of a tensor's raw bytes in logical order."""
    if not isinstance(t, torch.Tensor):
        return {"value": repr(t)}
    out = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "stride": list(t.stride()),
           "device": t.device.type}
    if t.device.type == "meta" or t.layout is not torch.strided:
        return out
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    out["sha"] = hashlib.sha256(raw).hexdigest()[:16]
    return out


def _fingerprint(t) -> str:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return repr(type(t))
    if t.layout is not torch.strided:
        t = t.to_dense()
    # The version counter too: an in-place write of the same bits still counts as touching.
    return digest(t)["sha"] + ("" if t.is_inference() else f"@{t._version}")


def message(e: BaseException) -> str:
    # torch appends the C++ frames of its own errors ("Exception raised from ..."): addresses.
    return str(e).split("\nException raised from ")[0]


# ---------------------------------------------------------------------------------------------
# Calls.


def _module(n, opts, weight, plain: bool):
    kw = {k: v for k, v in opts.items() if k in ("cast", "residual_rounding", "residual_dtype")}
    norm = dsnorm.RMSNorm(n, opts.get("eps", 1e-6), **kw)
    if isinstance(weight, torch.Tensor):  # (a non-tensor gain cannot be a module's parameter)
        with torch.no_grad():
            if (weight.dtype == torch.float32 and weight.shape == norm.weight.shape and weight.is_cpu
                    and weight.layout is torch.strided):
                norm.weight.copy_(weight)
            else:  # another gain dtype, shape, device or layout: replace the parameter as a user could
                norm.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    if plain is False and opts.get("requires_grad_weight"):
        norm.weight.requires_grad_(True)
    return norm


def _call(api, t, opts):
    """Run one public call; returns its outputs (a tuple of tensors) and the tensors whose
    gradients are recorded, if any."""
    x, r, w = t.get("x"), t.get("residual"), t.get("weight")
    eps = opts.get("eps", 1e-6)
    core = {k: opts[k] for k in ("cast", "residual_rounding", "residual_dtype") if k in opts}
    fp8 = {k: opts[k] for k in ("scale_fmt", "block_size", "return_normed", "cast", "residual_rounding",
                                "residual_dtype") if k in opts}
    if api == "rms_norm":
        return (dsnorm.rms_norm(x, w, eps, **core),)
    if api == "fused_add_rms_norm":
        return dsnorm.fused_add_rms_norm(x, r, w, eps, **core)
    if api == "fused_add_rms_norm_":
        out = dsnorm.fused_add_rms_norm_(x, r, w, eps, **core)
        return (*out, out[0] is x and out[1] is r)
    if api in ("module", "module_fused"):
        norm = _module(x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 1, opts, w, api == "module")
        if opts.get("hook"):
            norm.register_forward_hook(lambda m, a, o: None)  # off the module's fast lane
        out = norm(x) if api == "module" else norm(x, r)
        return out if isinstance(out, tuple) else (out,)
    if api == "op_rms_norm":
        return (torch.ops.dsnorm.rms_norm(x, w, eps, opts.get("cast", "deepseek")),)
    if api == "op_rms_norm_fwd":
        return torch.ops.dsnorm.rms_norm_fwd(x, w, eps, opts.get("cast", "deepseek"))
    if api in ("op_fused_add_rms_norm", "op_fused_add_rms_norm_fwd"):
        op = torch.ops.dsnorm.fused_add_rms_norm if api == "op_fused_add_rms_norm" else \
            torch.ops.dsnorm.fused_add_rms_norm_fwd
        return op(x, r, w, eps, opts.get("cast", "deepseek"), opts.get("residual_rounding", "fp32_sum"),
                  opts.get("residual_dtype"))
    if api == "op_fused_add_rms_norm_":
        out = torch.ops.dsnorm.fused_add_rms_norm_(x, r, w, eps, opts.get("cast", "deepseek"),
                                                   opts.get("residual_rounding", "fp32_sum"))
        return (x, r, out)
    if api == "op_rms_norm_bwd":
        _, rstd = torch.ops.dsnorm.rms_norm_fwd(x, w, eps, "deepseek")
        return torch.ops.dsnorm.rms_norm_bwd(t["dy"], x, w, rstd)
    if api == "op_fused_add_rms_norm_bwd":
        rr = opts.get("residual_rounding", "fp32_sum")
        _, _, rstd = torch.ops.dsnorm.fused_add_rms_norm_fwd(x, r, w, eps, "deepseek", rr, None)
        return torch.ops.dsnorm.fused_add_rms_norm_bwd(t["dy"], x, r, w, rstd, t.get("dr"), rr)
    if api == "rms_norm_fp8":
        return dsnorm.rms_norm_fp8(x, w, eps, **fp8)
    if api == "fused_add_rms_norm_fp8":
        return dsnorm.fused_add_rms_norm_fp8(x, r, w, eps, **fp8)
    if api == "op_rms_norm_fp8":
        return torch.ops.dsnorm.rms_norm_fp8(x, w, eps, opts.get("scale_fmt"), opts.get("block_size", 128),
                                             opts.get("return_normed", False))
    if api == "final_norm":
        kw = {k: opts[k] for k in ("last_only", "cast", "residual_rounding", "residual_dtype") if k in opts}
        return dsnorm.final_norm(x, r, w, eps, lengths=t.get("lengths"), **kw)
    if api == "mla_latent_norms":
        kw = {"cast": opts["cast"]} if "cast" in opts else {}
        return dsnorm.mla_latent_norms(x, t["kv_a"], w, t["kv_weight"], eps, **kw)
    if api in ("backward", "backward_fused", "backward_module", "backward_module_fused"):
        fused = api.endswith("fused")
        if api.startswith("backward_module"):
            norm = _module(x.shape[-1], opts, w, False)
            norm.weight.requires_grad_(True)
            out = norm(x, r) if fused else (norm(x),)
            wt = norm.weight
        else:
            out = dsnorm.fused_add_rms_norm(x, r, w, eps, **core) if fused else (dsnorm.rms_norm(x, w, eps, **core),)
            wt = w
        use = opts.get("use", "both")
        pairs = [(out[0], t["dy"])] if use in ("both", "y") else []
        if fused and use in ("both", "r"):
            pairs.append((out[1], t["dr"]))
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = [x.grad, r.grad if fused else None, wt.grad]
        return (*out, *grads)
    raise ValueError(f"unknown api {api!r}")


def run(recipe: dict) -> dict:
    """The result of one recipe (see the module docstring)."""
    if "alias" in recipe.get("options", {}):
        return _run_aliased(recipe)
    tensors = {k: make(v) for k, v in recipe.get("inputs", {}).items()}
    opts = {k: decode(v) for k, v in recipe.get("options", {}).items()}
    before = {k: _fingerprint(v) for k, v in tensors.items()}
    threads = torch.get_num_threads()
    mode = recipe.get("mode", "no_grad")
    ctx = {"no_grad": torch.no_grad, "inference": torch.inference_mode,
           "grad": contextlib.nullcontext}[mode]
    try:
        with ctx():
            out = _call(recipe["api"], tensors, opts)
    except Exception as e:  # noqa: BLE001 (every exception is a recorded result)
        return {"raises": [type(e).__name__, message(e)],
                "inputs_untouched": all(_fingerprint(v) == before[k] for k, v in tensors.items())}
    finally:
        torch.set_num_threads(threads)
    after = {k: _fingerprint(v) for k, v in tensors.items()}
    return {"outputs": [digest(o) for o in out],
            "inputs_changed": sorted(k for k in tensors if after[k] != before[k])}


def _run_aliased(recipe: dict) -> dict:
    """In place with x, residual and weight taken from one buffer: two views that share no element
    (accepted eagerly), one view twice, overlapping views, a weight inside x; and an fp32 stream."""
    buf = make(recipe["inputs"]["buffer"])
    case, n = recipe["options"]["alias"], 77
    x, r, w = buf[:, :n], buf[:, n:2 * n], torch.ones(n)
    if case == "same":
        r = x
    elif case == "overlap":
        r = buf[:, 40:40 + n]
    elif case == "weight_in_x":
        w = buf[0, :n]
    elif case.startswith("residual_fp32"):
        r = make({"shape": [3, n], "dtype": "fp32", "seed": 7})
    rr = "round_first" if case == "residual_fp32_rf" else "fp32_sum"
    before = [_fingerprint(t) for t in (buf, r, w)]
    try:
        with torch.no_grad():
            if recipe["api"] == "fused_add_rms_norm_":
                dsnorm.fused_add_rms_norm_(x, r, w, residual_rounding=rr)
            else:
                torch.ops.dsnorm.fused_add_rms_norm_(x, r, w, 1e-6, "deepseek", rr)
    except Exception as e:  # noqa: BLE001 (every exception is a recorded result)
        return {"raises": [type(e).__name__, message(e)],
                "inputs_untouched": before == [_fingerprint(t) for t in (buf, r, w)]}
    return {"outputs": [digest(buf), digest(r)], "inputs_changed": ["buffer"]}


# ---------------------------------------------------------------------------------------------
# The space. Every recipe gets its own seed from its position, so adding cases at the end keeps
# the earlier ones' inputs.

CORE_APIS = ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "module", "module_fused",
             "op_rms_norm", "op_fused_add_rms_norm", "op_fused_add_rms_norm_")
FUSED_APIS = ("fused_add_rms_norm", "fused_add_rms_norm_", "module_fused", "op_fused_add_rms_norm",
              "op_fused_add_rms_norm_")
PLAIN_APIS = ("rms_norm", "module", "op_rms_norm")
FLOATS = ("bf16", "fp16", "fp32", "fp64")
WIDTHS = (1, 3, 7, 8, 16, 77, 128, 512, 543, 544, 1000, 1536, 4096, 7168)


def _lead(width: int) -> list:
    # Small row counts (a few thousand elements): the DeepSeek widths as decode [B, 1, d].
    if width >= 1536:
        return [2, 1]
    if width >= 512:
        return [3]
    return [2, 3]


def _core(api, x, residual=None, weight=None, options=None, mode="no_grad", extra=None):
    """A recipe for a core-form call; ``residual``/``weight`` default to x's shape and dtype and a
    random gain in float32 (the ops': the compute dtype)."""
    n = x["shape"][-1] if x.get("shape") else 1
    inputs = {"x": x}
    if api in FUSED_APIS or residual is not None:
        inputs["residual"] = residual if residual is not None else {**x, "seed": x.get("seed", 0) + 1}
    # The ops take the gain in the compute dtype (fp64 for fp64 x); the functions widen any.
    wdtype = "fp64" if api.startswith("op_") and x.get("dtype") == "fp64" else "fp32"
    inputs["weight"] = weight if weight is not None else {"shape": [n], "dtype": wdtype, "fill": "normal",
                                                          "seed": x.get("seed", 0) + 2}
    if extra:
        inputs.update(extra)
    return {"api": api, "inputs": inputs, "options": options or {}, "mode": mode}


def space() -> list:
    """Every recipe, in a fixed order."""
    cases = []

    def add(kind, recipe):
        recipe["kind"] = kind
        cases.append(recipe)

    seed = itertools.count(1000, 7)

    # Every core entry point, dtype and width, contiguous random rows.
    for api, dt, n in itertools.product(CORE_APIS, FLOATS, WIDTHS):
        add("grid", _core(api, {"shape": _lead(n) + [n], "dtype": dt, "seed": next(seed)}))

    # Layouts: strided rows (the kv_norm slice), offsets, transposed, broadcast, non-collapsing.
    layouts = (("pad:64", (512,)), ("pad:5", (3, 77)), ("off:3", (77, 8)), ("t", (3, 16)),
               ("expand", (3, 77)), ("gap", (7, 128)))
    for api, dt, (layout, widths) in itertools.product(CORE_APIS, FLOATS, layouts):
        for n in widths:
            x = {"shape": [2, 3, n], "dtype": dt, "layout": layout, "seed": next(seed)}
            add("layout", _core(api, x))
            if api in FUSED_APIS and layout in ("pad:5", "gap"):  # strided x, contiguous residual
                add("layout", _core(api, x, residual={"shape": [2, 3, n], "dtype": dt, "seed": next(seed)}))

    # Options of the fused forms: cast x residual_rounding x residual_dtype x residual dtype.
    for api, dt, cast, rr, rdt, res in itertools.product(
            FUSED_APIS, FLOATS, ("deepseek", "hf"), ("fp32_sum", "round_first"), (None, "fp32"),
            ("same", "bf16", "fp16", "fp32")):
        if res != "same" and res == dt:
            continue
        x = {"shape": [3, 77], "dtype": dt, "seed": next(seed)}
        options = {"cast": cast, "residual_rounding": rr}
        if rdt is not None:
            options["residual_dtype"] = {"dtype": rdt}
        residual = {**x, "seed": x["seed"] + 1, "dtype": dt if res == "same" else res}
        add("options", _core(api, x, residual=residual, options=options))
    for api, dt, cast in itertools.product(PLAIN_APIS, FLOATS, ("deepseek", "hf")):
        for n in (3, 512, 7168):
            add("options", _core(api, {"shape": _lead(n) + [n], "dtype": dt, "seed": next(seed)},
                                 options={"cast": cast}))

    # Gains: dtype and fill (an fp64 gain is narrowed; bf16/fp16 widened exactly).
    for api, dt, wdt, wfill in itertools.product(CORE_APIS, FLOATS, ("bf16", "fp16", "fp32", "fp64"),
                                                 ("ones", "normal")):
        x = {"shape": [3, 77], "dtype": dt, "seed": next(seed)}
        add("weight", _core(api, x, weight={"shape": [77], "dtype": wdt, "fill": wfill, "seed": next(seed)},
                            options={"cast": "hf"} if wfill == "normal" and wdt == "bf16" else None))

    # eps: the valid range's ends and everything outside it.
    eps_values = (1e-6, 1e-5, 0.5, 1e-45, 1.401298464324817e-45, 3.4028235e38, 1e30, 7e-46, 3.5e38, 0.0, -1e-6,
                  {"float": "nan"}, {"float": "inf"}, True, "1e-6", None, {"np16": 0.001}, 1, 2**200)
    for api, dt, eps in itertools.product(CORE_APIS, ("bf16", "fp32", "fp64"), eps_values):
        add("eps", _core(api, {"shape": [2, 77], "dtype": dt, "scale": 1e-3, "seed": next(seed)},
                         options={"eps": eps}))

    # Special values and extreme rows.
    fills = (("special", 1.0), ("zeros", 1.0), ("negzeros", 1.0), ("subnormal", 1.0), ("randbits", 1.0),
             ("nanrow", 1.0), ("infrow", 1.0), ("normal", 1e30), ("normal", 1e-30), ("normal", 6e4),
             ("normal", 1e19), ("normal", 1e-20))
    for api, dt, (fill, scale), n in itertools.product(CORE_APIS, FLOATS, fills, (8, 77, 1000)):
        x = {"shape": [3, n], "dtype": dt, "fill": fill, "scale": scale, "seed": next(seed)}
        add("special", _core(api, x))

    # Empty inputs, scalars, width 0.
    for api, dt, shape in itertools.product(CORE_APIS, FLOATS, ([0, 77], [2, 0, 7168], [77], [0, 0], [],
                                                                [2, 0])):
        x = {"shape": shape, "dtype": dt, "seed": next(seed)}
        w = {"shape": [shape[-1] if shape else 1], "dtype": "fp32", "fill": "ones"}
        add("empty", _core(api, x, weight=w))

    # Threaded sizes (above the serial size) and a row wider than torch's split.
    for api, dt in itertools.product(CORE_APIS, ("bf16", "fp32")):
        for shape, layout in (([4, 7168], "contig"), ([64, 512], "pad:64"), ([1, 16385], "contig")):
            add("large", _core(api, {"shape": shape, "dtype": dt, "layout": layout, "seed": next(seed)}))

    # Grad modes of the forward calls: inference mode, grad mode without and with requires_grad.
    for api, dt, mode in itertools.product(("rms_norm", "fused_add_rms_norm", "module", "module_fused",
                                            "op_rms_norm", "op_fused_add_rms_norm"), FLOATS,
                                           ("inference", "grad", "train")):
        x = {"shape": [2, 1, 1536], "dtype": dt, "seed": next(seed)}
        if mode == "train":
            x["requires_grad"] = True
        add("mode", _core(api, x, mode="grad" if mode == "train" else mode))
    for api in ("fused_add_rms_norm_", "op_fused_add_rms_norm_"):
        for who, mode in itertools.product(("x", "residual", "weight"), ("grad", "no_grad")):
            r = _core(api, {"shape": [2, 77], "dtype": "bf16", "seed": next(seed)}, mode=mode)
            r["inputs"][who]["requires_grad"] = True
            add("mode", r)
        for layout, mode in itertools.product(("x", "residual"), ("inference", "no_grad", "grad")):
            r = _core(api, {"shape": [2, 77], "dtype": "bf16", "seed": next(seed)}, mode=mode)
            r["inputs"][layout]["layout"] = "inference"
            add("mode", r)

    # Modules with a hook (off the module's fast lane) and with options.
    for api, dt in itertools.product(("module", "module_fused"), FLOATS):
        r = _core(api, {"shape": [3, 512], "dtype": dt, "seed": next(seed)}, options={"hook": True})
        add("module", r)
        r = _core(api, {"shape": [3, 512], "dtype": dt, "seed": next(seed)},
                  options={"cast": "hf", "residual_rounding": "round_first"})
        add("module", r)

    # Backward: gradients of x, residual and weight.
    for api, dt, n, layout, use in itertools.product(
            ("backward", "backward_fused", "backward_module", "backward_module_fused"), FLOATS,
            (1, 3, 77, 512, 1536), ("contig", "pad:7"), ("both", "y", "r")):
        fused = api.endswith("fused")
        if use == "r" and not fused:
            continue
        x = {"shape": [3, n], "dtype": dt, "layout": layout, "seed": next(seed), "requires_grad": True}
        extra = {"dy": {"shape": [3, n], "dtype": dt, "seed": next(seed)},
                 "dr": {"shape": [3, n], "dtype": dt, "seed": next(seed)}}
        w = {"shape": [n], "dtype": "fp32", "seed": next(seed), "requires_grad": True}
        r = _core("fused_add_rms_norm" if fused else "rms_norm", x, weight=w, mode="grad", extra=extra)
        r["api"] = api
        if fused:
            r["inputs"]["residual"] = {**x, "seed": next(seed)}
        r["options"] = {"use": use}
        add("backward", r)
    for dt, wdt, rr, rdt in itertools.product(FLOATS, ("bf16", "fp32"), ("fp32_sum", "round_first"),
                                             ("same", "fp32")):
        x = {"shape": [2, 1, 512], "dtype": dt, "seed": next(seed), "requires_grad": True}
        extra = {"dy": {"shape": [2, 1, 512], "dtype": dt, "seed": next(seed)},
                 "dr": {"shape": [2, 1, 512], "dtype": dt, "seed": next(seed)}}
        r = _core("fused_add_rms_norm", x, weight={"shape": [512], "dtype": wdt, "seed": next(seed),
                                                  "requires_grad": True},
                  mode="grad", extra=extra, options={"residual_rounding": rr, "use": "both"})
        r["api"] = "backward_fused"
        r["inputs"]["residual"] = {**x, "seed": next(seed), "dtype": dt if rdt == "same" else rdt}
        add("backward", r)
    for dt, n in itertools.product(FLOATS, (3, 77, 1536)):
        x = {"shape": [3, n], "dtype": dt, "seed": next(seed)}
        extra = {"dy": {"shape": [3, n], "dtype": dt, "seed": next(seed)}}
        add("backward", _core("op_rms_norm_bwd", {**x}, extra=extra))
        for rr in ("fp32_sum", "round_first"):
            extra = {"dy": {"shape": [3, n], "dtype": dt, "seed": next(seed)},
                     "residual": {**x, "seed": next(seed)},
                     "dr": {"shape": [3, n], "dtype": dt, "seed": next(seed)}}
            r = _core("op_rms_norm_bwd", x, extra=extra, options={"residual_rounding": rr})
            r["api"] = "op_fused_add_rms_norm_bwd"
            add("backward", r)
    for dt in FLOATS:
        x = {"shape": [3, 77], "dtype": dt, "seed": next(seed)}
        add("backward", _core("op_rms_norm_fwd", x))
        add("backward", _core("op_fused_add_rms_norm_fwd", x, residual={**x, "seed": next(seed)}))

    # fp8 fusions.
    for api, dt, (n, bs), fmt, normed in itertools.product(
            ("rms_norm_fp8", "fused_add_rms_norm_fp8", "op_rms_norm_fp8"), ("bf16", "fp16", "fp32", "fp64"),
            ((128, 128), (7168, 128), (512, 128), (256, 16), (4096, 4096), (192, 64), (100, 128), (128, 100),
             (128, 256), (128, 8)),
            (None, "ue8m0"), (False, True)):
        x = {"shape": [2, 1, n], "dtype": dt, "seed": next(seed)}
        extra = {"residual": {**x, "seed": next(seed)}} if api == "fused_add_rms_norm_fp8" else None
        add("fp8", _core(api, x, extra=extra, options={"scale_fmt": fmt, "block_size": bs, "return_normed": normed}))
    for api, dt, (fill, scale) in itertools.product(("rms_norm_fp8", "fused_add_rms_norm_fp8"), ("bf16", "fp32"),
                                                    fills):
        x = {"shape": [3, 256], "dtype": dt, "fill": fill, "scale": scale, "seed": next(seed)}
        extra = {"residual": {**x, "seed": next(seed)}} if api == "fused_add_rms_norm_fp8" else None
        for fmt in (None, "ue8m0"):
            add("fp8", _core(api, x, extra=extra, options={"scale_fmt": fmt}))
    fp8_bad = ({"scale_fmt": "ue4m3"}, {"block_size": True}, {"block_size": 128.0}, {"block_size": 8192},
               {"cast": "hf"}, {"residual_rounding": "round_first"}, {"residual_dtype": {"dtype": "fp32"}},
               {"eps": 0.0}, {"return_normed": 1})
    for api, bad in itertools.product(("rms_norm_fp8", "fused_add_rms_norm_fp8"), fp8_bad):
        if api == "rms_norm_fp8" and ("residual_rounding" in bad or "residual_dtype" in bad):
            continue
        x = {"shape": [2, 128], "dtype": "bf16", "seed": next(seed)}
        extra = {"residual": {**x, "seed": next(seed)}} if api == "fused_add_rms_norm_fp8" else None
        add("fp8", _core(api, x, extra=extra, options=bad))
    for api in ("rms_norm_fp8", "fused_add_rms_norm_fp8"):
        for layout in ("pad:64", "t", "gap"):
            x = {"shape": [2, 4, 128], "dtype": "bf16", "layout": layout, "seed": next(seed)}
            extra = {"residual": {**x, "seed": next(seed), "layout": "contig"}} if api != "rms_norm_fp8" else None
            add("fp8", _core(api, x, extra=extra))
        x = {"shape": [2, 128], "dtype": "bf16", "seed": next(seed), "requires_grad": True}
        extra = {"residual": {**x, "seed": next(seed), "requires_grad": False}} if api != "rms_norm_fp8" else None
        add("fp8", _core(api, x, extra=extra, mode="grad"))
        add("fp8", _core(api, {"shape": [0, 128], "dtype": "fp32", "seed": next(seed)},
                         extra={"residual": {"shape": [0, 128], "dtype": "fp32"}} if api != "rms_norm_fp8" else None))
        x = {"shape": [2, 128], "dtype": "bf16", "seed": next(seed)}
        extra = {"residual": {**x, "seed": next(seed), "dtype": "fp32"}} if api != "rms_norm_fp8" else None
        add("fp8", _core(api, x, extra=extra, weight={"shape": [128], "dtype": "bf16", "seed": next(seed)}))

    # final_norm.
    for dt, (b, t, n), last_only, lengths in itertools.product(
            FLOATS, ((2, 5, 77), (1, 3, 7168), (3, 1, 1), (0, 4, 16)), (True, False), (None, "ok", "bad")):
        x = {"shape": [b, t, n], "dtype": dt, "seed": next(seed)}
        extra = {"residual": {**x, "seed": next(seed)}}
        if lengths == "ok":
            extra["lengths"] = {"values": [max(1, t - i % max(t, 1)) for i in range(b)]}
        elif lengths == "bad":
            extra["lengths"] = {"shape": [b], "dtype": "fp32", "fill": "ones"}
        options = {"last_only": last_only}
        add("final_norm", {**_core("fused_add_rms_norm", x, extra=extra, options=options), "api": "final_norm"})
    for dt in ("bf16", "fp32"):
        for lens in ([1, 5], [5, 5], [0, 3], [6, 1], [3]):
            x = {"shape": [2, 5, 77], "dtype": dt, "seed": next(seed)}
            extra = {"residual": {**x, "seed": next(seed)}, "lengths": {"values": lens}}
            add("final_norm", {**_core("fused_add_rms_norm", x, extra=extra), "api": "final_norm"})
        for bad in ({"last_only": 1}, {"cast": "hf"}, {"residual_rounding": "round_first"},
                    {"residual_dtype": {"dtype": "fp32"}}, {"eps": -1.0}):
            x = {"shape": [2, 5, 77], "dtype": dt, "seed": next(seed)}
            add("final_norm", {**_core("fused_add_rms_norm", x, extra={"residual": {**x, "seed": next(seed)}},
                                       options=bad), "api": "final_norm"})
        for res in ({"shape": [2, 5, 77], "dtype": "fp32"}, {"shape": [2, 4, 77], "dtype": dt},
                    {"shape": [2, 5, 77], "dtype": dt, "layout": "pad:3"}):
            x = {"shape": [2, 5, 77], "dtype": dt, "seed": next(seed)}
            add("final_norm", {**_core("fused_add_rms_norm", x, extra={"residual": {**res, "seed": next(seed)}}),
                               "api": "final_norm"})
        x = {"shape": [2, 5, 77], "dtype": dt, "layout": "pad:3", "seed": next(seed)}
        add("final_norm", {**_core("fused_add_rms_norm", x, extra={"residual": {**x, "seed": next(seed)}}),
                           "api": "final_norm"})
        x = {"shape": [5, 77], "dtype": dt, "seed": next(seed)}
        add("final_norm", {**_core("fused_add_rms_norm", x, extra={"residual": {**x, "seed": next(seed)}}),
                           "api": "final_norm"})

    # mla_latent_norms: the 671B widths, small ones, decode and prefill, and bad pairs.
    mla_shapes = (([1, 1], 1536, 576, 512), ([4, 1], 1536, 576, 512), ([2, 33], 1536, 576, 512),
                  ([3], 64, 56, 48), ([0, 1], 64, 56, 48), ([2], 8, 5, 5), ([2], 8, 5, 6), ([2], 8, 5, 0))
    for dt, (lead, q, kv, r) in itertools.product(FLOATS, mla_shapes):
        s = next(seed)
        extra = {"kv_a": {"shape": lead + [kv], "dtype": dt, "seed": s + 1},
                 "kv_weight": {"shape": [r], "dtype": "fp32", "seed": s + 2}}
        add("mla", _core("mla_latent_norms", {"shape": lead + [q], "dtype": dt, "seed": s}, extra=extra))
    for bad in ({"kv_a": {"shape": [2, 56], "dtype": "bf16"}}, {"kv_a": {"shape": [3, 56], "dtype": "fp16"}},
                {"kv_a": {"shape": [3, 56], "dtype": "bf16", "layout": "pad:3"}},
                {"kv_a": {"shape": [3, 56], "dtype": "bf16", "layout": "t"}},
                {"kv_weight": {"shape": [48], "dtype": "bf16"}}, {"kv_weight": {"shape": [48, 1], "dtype": "fp32"}},
                {"options": {"cast": "hf"}}, {"options": {"eps": 0.0}}, {"kv_a": [1.0]},
                {"x": {"shape": [3, 64], "dtype": "bf16", "layout": "pad:8"}}):
        s = next(seed)
        inputs = {"x": {"shape": [3, 64], "dtype": "bf16", "seed": s},
                  "kv_a": {"shape": [3, 56], "dtype": "bf16", "seed": s + 1},
                  "weight": {"shape": [64], "dtype": "fp32", "seed": s + 2},
                  "kv_weight": {"shape": [48], "dtype": "fp32", "seed": s + 3}}
        options = bad.pop("options", {}) if "options" in bad else {}
        for k, v in bad.items():
            inputs[k] = {**v, "seed": s + 4} if isinstance(v, dict) else v
        add("mla", {"api": "mla_latent_norms", "inputs": inputs, "options": options, "mode": "no_grad"})

    # Bad arguments of the core forms, each against every entry point.
    bad_inputs = (
        {"x": {"shape": [2, 77], "dtype": "int32"}}, {"x": {"shape": [2, 77], "dtype": "fp8"}},
        {"x": {"shape": [2, 77], "dtype": "c64"}}, {"x": [1.0, 2.0]}, {"x": None},
        {"weight": {"shape": [76], "dtype": "fp32"}}, {"weight": {"shape": [1, 77], "dtype": "fp32"}},
        {"weight": {"shape": [77], "dtype": "int32"}}, {"weight": {"shape": [77], "dtype": "fp32", "layout": "meta"}},
        {"weight": {"shape": [77, 2], "dtype": "fp32", "layout": "t"}}, {"weight": [1.0]},
        {"weight": {"shape": [77], "dtype": "fp32", "layout": "sparse"}},
        {"x": {"shape": [2, 77], "dtype": "x", "layout": "sparse"}},
        {"x": {"shape": [2, 77], "dtype": "x", "layout": "meta"},
         "residual": {"shape": [2, 77], "dtype": "x", "layout": "meta"},
         "weight": {"shape": [77], "dtype": "fp32", "layout": "meta"}},
        {"residual": {"shape": [2, 76], "dtype": "x"}}, {"residual": {"shape": [1, 77], "dtype": "x"}},
        {"residual": {"shape": [2, 77], "dtype": "fp64"}}, {"residual": {"shape": [2, 77], "dtype": "int32"}},
        {"residual": {"shape": [2, 77], "dtype": "x", "layout": "meta"}}, {"residual": None},
        {"residual": {"shape": [2, 77], "dtype": "x", "layout": "expand"}},
        {"residual": {"shape": [2, 77], "dtype": "x", "layout": "t"}},
        {"x": {"shape": [2, 77], "dtype": "x", "layout": "expand"}},
        {"x": {"shape": [3, 77], "dtype": "x", "layout": "t"}},
        {"options": {"cast": "HF"}}, {"options": {"cast": None}}, {"options": {"residual_rounding": "round"}},
        {"options": {"residual_dtype": {"dtype": "bf16"}}}, {"options": {"residual_dtype": {"dtype": "fp64"}}},
        {"options": {"residual_dtype": "float32"}},
        {"options": {"residual_rounding": "round_first", "residual_dtype": {"dtype": "fp32"}}},
    )
    for api, dt, bad in itertools.product(CORE_APIS, ("bf16", "fp32"), bad_inputs):
        if "residual" in bad and "x" not in bad and api not in FUSED_APIS:
            continue
        bad = {k: (dict(v) if isinstance(v, dict) else v) for k, v in bad.items()}
        r = _core(api, {"shape": [2, 77], "dtype": dt, "seed": next(seed)})
        for k, v in bad.pop("options", {}).items():
            r["options"][k] = v
        for k, v in bad.items():
            if isinstance(v, dict) and v.get("dtype") == "x":  # x's dtype
                v["dtype"] = dt
            r["inputs"][k] = {**v, "seed": next(seed)} if isinstance(v, dict) else v
        add("bad", r)

    # In place: shared buffers (two views of one buffer, overlapping views, a weight inside x).
    for api, dt in itertools.product(("fused_add_rms_norm_", "op_fused_add_rms_norm_"), ("bf16", "fp32")):
        for case in ("halves", "same", "overlap", "weight_in_x", "residual_fp32", "residual_fp32_rf"):
            add("inplace_alias", {"api": api, "inputs": {"buffer": {"shape": [3, 160], "dtype": dt,
                                                                    "seed": next(seed)}},
                                  "options": {"alias": case}, "mode": "no_grad"})
    return cases




# ---------------------------------------------------------------------------------------------
# Running the set and comparing it with the record.


def run_all(recipes: list) -> list:
    return [run(r) for r in recipes]


def expected(case: dict, capability: str) -> dict:
    """The recorded result of a case under a capability (most are the same under all of them)."""
    return case["by_capability"][capability] if "by_capability" in case else case["result"]


# torch's "no kernel for this backend" errors list where each key's kernel was registered (the
# file and line of dsnorm's ``torch.library.Library``): where the checkout lies, not what it does.
_REGISTERED_AT = re.compile(r"registered at [^ \n]+:\d+")


def _located_nowhere(result: dict) -> dict:
    if "raises" not in result:
        return result
    kind, text = result["raises"]
    return {**result, "raises": [kind, _REGISTERED_AT.sub("registered at <file>:<line>", text)]}


def differences(golden: dict, results: list, capability: str) -> list:
    """``[(index, recipe, expected, got)]`` for every case whose result differs from the record
    (error messages compared without torch's registration locations, see _REGISTERED_AT)."""
    return [(i, case["recipe"], expected(case, capability), got)
            for i, (case, got) in enumerate(zip(golden["cases"], results))
            if _located_nowhere(expected(case, capability)) != _located_nowhere(got)]
