"""Verification against the reference: distances in ulps (:func:`ulp_distance`), one output
against the reference's (:func:`compare`, :func:`max_rel_err` for gradients; a fusion's output
tuple: :func:`_outputs_equal`), and the rules a dsnorm row must meet (:func:`fidelity_criterion`,
:func:`gradient_criterion`, :func:`meets_fidelity`; a fusion's: :func:`fusion_fidelity_ok`)."""

from __future__ import annotations

import platform

import torch

from dsnorm.bench.cases import DTYPE

# Widths up to which dsnorm's CPU kernels reproduce torch's reduction order bit for bit.
BITWISE_MAX_WIDTH = 16384


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
