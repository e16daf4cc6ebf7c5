"""Shared test helpers: ulp distances and the fidelity rule of the core issue."""

import platform

import pytest
import torch

# torch reduces fp32 rows with 8-lane vectors on x86 (AVX2 build, also used where it reports
# AVX512): dsnorm replays that order bit for bit there, for rows torch does not split (<= 16384).
X86_CAPABILITIES = ("AVX2", "AVX512", "DEFAULT")
BITWISE_MAX_WIDTH = 16384


def bitwise_expected(width: int) -> bool:
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.cpu.get_cpu_capability() in X86_CAPABILITIES
        and width <= BITWISE_MAX_WIDTH
    )


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns onto a monotone integer line (so ulp = |difference|)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}[t.dtype]
    i = t.contiguous().view(bits).to(torch.int64)
    sign_bit = 1 << (torch.iinfo(bits).bits - 1)
    return torch.where(i < 0, -(i + sign_bit), i)


def max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return 0
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = (_ordered(a) - _ordered(b)).abs()
    d = torch.where(both_nan, torch.zeros_like(d), d)
    return int(d.max())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (the sign of zero included), except that a NaN only has to be a NaN where
    the other one is: torch's own CPU conversion gives different NaN payloads in its vector and
    scalar paths."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia, ib = a.contiguous().view(bits), b.contiguous().view(bits)
    return bool(((ia == ib) | nan_a).all())


def assert_y_close(y: torch.Tensor, y_ref: torch.Tensor, width: int, cast: str = "deepseek") -> None:
    """The core fidelity criterion for y: bitwise where reachable, else 1 ulp / 4e-6 relative (2 ulps
    for cast="hf", which rounds x̂ to the dtype before the weight multiply: a 1-ulp x̂ from another
    sum order becomes up to 2 ulps of y)."""
    if bitwise_expected(width):
        assert bits_equal(y, y_ref), f"max ulp {max_ulp(y, y_ref)} at width {width}"
    elif y.dtype in (torch.bfloat16, torch.float16):
        assert max_ulp(y, y_ref) <= (2 if cast == "hf" else 1)
    else:
        torch.testing.assert_close(y, y_ref, rtol=4e-6, atol=0)


# One rounding of the output dtype (half an ulp, relative) on top of fp32 arithmetic.
_GRAD_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20, torch.float64: 1e-13}


def assert_grad_close(got: torch.Tensor, ref64: torch.Tensor, scale: float | None = None) -> None:
    """A gradient against fp64 autograd of the reference, elementwise: one rounding of got's dtype
    plus fp32 arithmetic error (1e-6) relative to ``scale``, the size of the terms that were added
    (``rstd * dy * w`` can cancel to a much smaller ds: for n=1, ds = rstd * g * eps / (s^2 + eps))."""
    assert got.shape == ref64.shape, (got.shape, ref64.shape)
    scale = max(float(ref64.abs().max()) if ref64.numel() else 0.0, scale or 0.0)
    err = (got.double() - ref64).abs()
    bound = _GRAD_ROUNDING[got.dtype] * ref64.abs() + (1e-13 if got.dtype == torch.float64 else 1e-6) * scale
    assert bool((err <= bound).all()), f"max err {float(err.max())}, scale {scale}"


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def assert_chain_shares_the_residual_gradient(monkeypatch, a, b, c, w, dy, dro, eps=1e-6) -> None:
    """Two fused norms in a chain (the second's residual is the first's residual_out), forward and
    backward, with dsnorm's sharing of the residual gradient on and then off (both written): on,
    the second norm hands one tensor to c and to r1; the leaves' gradients are the same bits."""
    import dsnorm
    from dsnorm import autograd

    def chain():
        xs = [t.clone().requires_grad_() for t in (a, b, c)]
        y1, r1 = dsnorm.fused_add_rms_norm(xs[0], xs[1], w, eps)
        y2, r2 = dsnorm.fused_add_rms_norm(xs[2], r1, w, eps)
        gc, gr1 = torch.autograd.grad((y2, r2), (xs[2], r1), (dy, dro), retain_graph=True)
        torch.autograd.backward((y1, y2, r2), (dy, dy, dro))
        return gc is gr1, [t.grad for t in xs]

    shared, got = chain()
    with monkeypatch.context() as patched:
        patched.setattr(autograd, "_FUSED_NODE", None)
        apart, want = chain()
    assert shared and not apart
    for g, h in zip(got, want):
        assert bits_equal(g, h)


def count_lane_calls(monkeypatch) -> list:
    """Counts of the training lane's forward calls, ``[plain, fused]``, updated as they happen
    (the lane's forwards wrapped through ``monkeypatch``)."""
    from dsnorm import ops

    calls = [0, 0]
    for i, name in enumerate(("rms_norm_fwd_unchecked", "fused_add_rms_norm_fwd_unchecked")):
        def counted(*args, _i=i, _f=getattr(ops, name)):
            calls[_i] += 1
            return _f(*args)
        monkeypatch.setattr(ops, name, counted)
    return calls


# Hypothesis (tests/test_properties.py): the profile is DSNORM_HYPOTHESIS ("ci" by default, or
# "long") and the seed DSNORM_HYPOTHESIS_SEED (39 in "ci"; a fresh one per run in "long"). Both are
# settled here in the controlling process, before xdist starts its workers, which inherit them
# through the environment; the seed is printed at the start and the end so that a failure replays.
def pytest_configure(config):
    import os
    import random

    if not hasattr(config, "workerinput"):
        profile = os.environ.setdefault("DSNORM_HYPOTHESIS", "ci")
        os.environ.setdefault("DSNORM_HYPOTHESIS_SEED", "39" if profile == "ci" else str(random.randrange(2**32)))


def _hypothesis_line() -> str:
    import os

    profile, seed = os.environ["DSNORM_HYPOTHESIS"], os.environ["DSNORM_HYPOTHESIS_SEED"]
    return (f"property tests: hypothesis profile {profile}, seed {seed} "
            f"(replay: DSNORM_HYPOTHESIS={profile} DSNORM_HYPOTHESIS_SEED={seed})")


def pytest_sessionstart(session):
    # Not pytest_report_header: the README's command runs with -q, which hides the header.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        reporter.write_line(_hypothesis_line())


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_hypothesis_line())


# The integration tests need an engine that the core test environment does not install. Where CI
# installs it (DSNORM_REQUIRE_EXTRAS="vllm", "kernels" or both, comma-separated), a missing engine
# fails the test instead of skipping it.
REQUIRED_EXTRAS = {e.strip() for e in __import__("os").environ.get("DSNORM_REQUIRE_EXTRAS", "").split(",") if e.strip()}


def require_extra(module: str, extra: str):
    """``import module``, or skip naming the extra to install (fail where CI requires it)."""
    if extra in REQUIRED_EXTRAS:
        return __import__("importlib").import_module(module)
    return pytest.importorskip(module, reason=f"needs the {extra!r} extra: pip install 'dsnorm[{extra}]'")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module, loaded by its path (benchmarks/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
