"""``python benchmarks/mutants.py [--list] [--only NAME ...]``: semantic mutants the suite must kill.

Each mutant is one small deliberate bug (a text substitution whose target must occur exactly once
in its file, so that a refactor fails this script loudly instead of silently applying nothing),
applied to a temporary copy of ``src/`` and ``tests/``; the tests that should catch it run against
the copy (``PYTHONPATH`` pointing at it). A mutant lists one or more selections of tests, each
run on its own; each must kill it, and a kill counts only when the failure is an assertion
(``AssertionError`` or pytest's ``Failed``, as ``benchmarks/mutant_outcomes.py`` records it): a
mutant that merely crashes the code (a numba typing error, a ``NameError``) "broke" and proves
nothing about the tests' checks. The selections must pass on the unmutated copy first (the
baseline), else a failure would prove nothing. Prints a table (mutant, tests run, killed by what or
broke or survived, the first failing test, time) and exits non-zero unless every selection killed
its mutant by an assertion.

Not part of CI: every mutant of a numba file recompiles the kernels it touches (minutes on two
cores). Run it before resolving an issue that touches kernels or checks. numba's cache lives in a
directory of this run: the baseline fills it, a mutant of another file reuses it, and a mutant of a
file whose code kernels compile in drops those kernels' caches (the kernels of ``dsnorm.cpu.kernels``
and ``dsnorm.cpu.fusion_kernels`` compile in the functions of the modules they import but are stamped
with their own file only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("src/dsnorm")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to src/dsnorm
    old: str
    new: str
    selections: tuple  # of pytest argument tuples (files, -k expressions), each run on its own
    what: str


# The tests that fail on any change to a module that kernels compile in (a digest, not semantics):
# never counted as a kill.
_DESELECT = ("--deselect",
             "tests/test_fusions.py::test_kernel_caches_are_invalidated_with_the_modules_they_compile_in")

_LANE = ("tests/test_lane.py", "-k", "test_lane_matches_reference")

MUTANTS = (
    Mutant(
        "cpu_fused_sum_rounded", "cpu/stages.py",
        "po[o_off + j] = bits\n            buf[j] = bf16_to_f32(bits) if round_first else v",
        "po[o_off + j] = bits\n            buf[j] = bf16_to_f32(bits)",
        (_LANE,), "CPU fused kernel normalises the rounded sum under fp32_sum (bf16, out of place; "
        "CPUs with AVX512-BF16, elsewhere cpu_late_fused_sum_rounded)",
    ),
    Mutant(
        "cpu_late_fused_sum_rounded", "cpu/stages.py",
        "        v = buf[j]\n        if with_o:",
        "        v = bf16_to_f32(_bf16_bits(buf[j], finite))\n        if with_o:",
        (_LANE,), "CPU fused kernel normalises the rounded sum under fp32_sum (bf16, without AVX512-BF16)",
    ),
    Mutant(
        "cpu_fp8_sum_rounded", "cpu/fusion_kernels.py",
        "rout_addr, rout_stride, x_code, I0, eps, NO, NO,",
        "rout_addr, rout_stride, x_code, I0, eps, NO, np.bool_(True),",
        (("tests/test_fusions.py", "-k", "test_fp8_bitwise"),),
        "CPU fp8 fusion normalises the rounded sum",
    ),
    Mutant(
        "triton_fused_sum_rounded", "triton/kernels.py",
        "        if ROUND_FIRST:\n            s = _round_to(s, XDT, CD)\n    return s",
        "        s = _round_to(s, XDT, CD)\n    return s",
        (("tests/test_triton_interpret.py", "-k", "test_fused_forward and not extremes"),
         ("tests/test_fusions_triton.py", "-k", "test_fp8_forward")),
        "Triton kernels' _load_s rounds the sum under fp32_sum too (core and fp8 kernels)",
    ),
    Mutant(
        "triton_fp8_sum_rounded", "triton/fusions.py",
        "s = kernels._load_s(x_row + cols, r_row + cols, mask, HAS_RESIDUAL, False, XDT, CD)\n"
        "        if HAS_RESIDUAL:\n            tl.store(RO",
        "s = kernels._load_s(x_row + cols, r_row + cols, mask, HAS_RESIDUAL, True, XDT, CD)\n"
        "        if HAS_RESIDUAL:\n            tl.store(RO",
        (("tests/test_fusions_triton.py", "-k", "test_fp8_forward"),),
        "Triton fp8 fusion (one-block rows) normalises the rounded sum",
    ),
    Mutant(
        "cast_deepseek_rounds_xhat", "cpu/stages.py",
        "return _bf16_bits(w * (v * rstd), finite)",
        "return _bf16_bits(w * round_to(v * rstd, BF16), finite)",
        (_LANE,), "cast='deepseek' rounds x-hat to bf16 before the weight multiply",
    ),
    Mutant(
        "cast_hf_keeps_fp32", "cpu/stages.py",
        "return _bf16_bits(_bf16_round(w, finite) * _bf16_round(v * rstd, finite), finite)",
        "return _bf16_bits(w * (v * rstd), finite)",
        (_LANE,), "cast='hf' multiplies in fp32 (DeepSeek's order) instead of rounding weight and x-hat",
    ),
    Mutant(
        "eps_inside_the_mean", "cpu/kernels.py",
        "rstd = one / np.sqrt(total / width + eps)",
        "rstd = one / np.sqrt((total + eps) / width)",
        (_LANE,), "eps added to the sum of squares before the division",
    ),
    Mutant(
        "cpu_rsqrt_by_pow", "cpu/kernels.py",
        "rstd = one / np.sqrt(total / width + eps)",
        "rstd = (total / width + eps) ** (-one / (one + one))",
        (("tests/test_fidelity.py", "-k", "test_plain_and_fused_match_reference"),),
        "rsqrt as one correctly rounded pow instead of torch's 1/sqrt (two roundings)",
    ),
    Mutant(
        "triton_approx_rsqrt", "triton/kernels.py",
        "out = tl.math.div_rn(1.0, tl.math.sqrt_rn(var))",
        "out = tl.math.rsqrt(var)",
        (("tests/test_triton_compile.py", "-k", "test_kernels_compile_for_sm90"),),
        "Triton rstd by the approximate rsqrt instruction (PTX compiled for sm_90)",
    ),
    Mutant(
        "bf16_row_finiteness_assumed", "cpu/kernels.py",
        "finite = gain_finite and total - total == 0.0",
        "finite = gain_finite",
        (("tests/test_fidelity.py", "-k", "nans_in_every_lane or without_avx512_bf16"),),
        "without AVX512-BF16, a row holding a NaN or an infinity is rounded without the NaN test",
    ),
    Mutant(
        "bf16_gain_finiteness_assumed", "cpu/kernels.py",
        "gain_finite = trick_bf16 and gain_is_finite(w_addr, n)",
        "gain_finite = trick_bf16",
        (("tests/test_fidelity.py", "-k", "infinities_nans_and_overflow or without_avx512_bf16"),),
        "without AVX512-BF16, a gain holding an infinity or a NaN is rounded without the NaN test",
    ),
    Mutant(
        "mean_divisor", "cpu/kernels.py",
        "    acc[0] = n\n    width = acc[0]",
        "    acc[0] = max(n - 1, 1)\n    width = acc[0]",
        (_LANE,), "the mean divides by n - 1",
    ),
    Mutant(
        "residual_returned_in_its_own_dtype", "ops.py",
        "residual_out = launcher.empty_output(x, residual_dtype or x.dtype)",
        "residual_out = launcher.empty_output(x, residual_dtype or residual.dtype)",
        (("tests/test_triton_interpret.py", "-k", "test_public_api_through_the_triton_launchers"),),
        "the general path returns residual_out in the residual's dtype instead of x's",
    ),
    Mutant(
        "lane_residual_returned_in_its_own_dtype", "cpu/lane.py",
        "out_dtype = dtype if residual_dtype is None else residual_dtype",
        "out_dtype = r_dtype if residual_dtype is None else residual_dtype",
        (("tests/test_fidelity.py", "-k", "test_residual_of_another_dtype_is_added_widened"),),
        "the CPU lane returns residual_out in the residual's dtype instead of x's",
    ),
    Mutant(
        "round_first_ignored", "cpu/stages.py",
        "po[o_off + j] = bits\n            buf[j] = bf16_to_f32(bits) if round_first else v",
        "po[o_off + j] = bits\n            buf[j] = v",
        (_LANE,), "residual_rounding='round_first' normalises the unrounded sum (bf16, out of place)",
    ),
    Mutant(
        "inplace_check_after_write", "ops.py",
        "    check_inplace_options(eps, cast, residual_rounding, x, residual)\n"
        "    _launcher(x).forward(\n"
        "        x, residual, weight, eps, cast == \"hf\", residual_rounding == \"round_first\", x, residual, None\n"
        "    )\n",
        "    _launcher(x).forward(\n"
        "        x, residual, weight, eps, cast == \"hf\", residual_rounding == \"round_first\", x, residual, None\n"
        "    )\n"
        "    check_inplace_options(eps, cast, residual_rounding, x, residual)\n",
        (("tests/test_ops.py", "-k", "test_inplace_errors_leave_inputs_untouched and cast"),),
        "the in-place form checks its options after writing x and residual",
    ),
    Mutant(
        "strided_rows_read_as_contiguous", "rows.py",
        "        if size != 1:\n            return stride\n",
        "        if size != 1:\n            return t.shape[-1]\n",
        (("tests/test_fidelity.py", "-k", "test_strided_rows_read_in_place"),),
        "row_stride ignores the rows' stride (kv_norm's 512-of-576 slice read as contiguous)",
    ),
    Mutant(
        "row_depends_on_batch", "cpu/kernels.py",
        "        if not narrow:\n            for t in range(group_len, 4 * group_len):",
        "        if not narrow and row == r0:\n            for t in range(group_len, 4 * group_len):",
        (("tests/test_fidelity.py", "-k", "test_batch_invariance"),),
        "a wide row's partial sums are cleared only for a thread's first row",
    ),
    Mutant(
        "cpu_ue8m0_rounds_down", "cpu/fusion_kernels.py",
        "bits = (bits & _U(0x7F800000)) + _U(0x800000)",
        "bits = bits & _U(0x7F800000)",
        (("tests/test_fusions.py", "-k", "test_ue8m0_rounding"),),
        "CPU ue8m0 scale rounded down to a power of two instead of up",
    ),
    Mutant(
        "triton_ue8m0_rounds_down", "triton/fusions.py",
        "s = tl.where(up, (sb & 0x7F800000) + 0x800000, sb)",
        "s = tl.where(up, sb & 0x7F800000, sb)",
        (("tests/test_fusions_triton.py", "-k", "test_block_scales"),),
        "Triton ue8m0 scale rounded down to a power of two instead of up",
    ),
    Mutant(
        "fp32_multiply_order", "cpu/stages.py",
        "pf[offset + j] = wf[j] * (buf[j] * rstd)",
        "pf[offset + j] = (wf[j] * buf[j]) * rstd",
        (("tests/test_autograd.py", "-k", "test_training_lane_leaves_other_tensors_to_the_general_path"),),
        "fp32 y as (w * s) * rstd: at most an ulp off, only a bitwise check sees it",
    ),
    Mutant(
        "fp64_multiply_order", "cpu/stages.py",
        "pd[offset + j] = wd[j] * (buf[j] * rstd)",
        "pd[offset + j] = (wd[j] * buf[j]) * rstd",
        (("tests/test_fidelity.py", "-k", "test_fp64_computed_in_fp64"),),
        "fp64 y as (w * s) * rstd: an ulp off, inside the rtol of 1e-14 that test had",
    ),
    Mutant(
        "dx_scaled", "cpu/kernels.py",
        "g[j] = rstd * (g[j] - buf[j] * mean_dot)",
        "g[j] = rstd * (g[j] - buf[j] * mean_dot) * 1.008",
        (("tests/test_autograd.py", "-k", "test_bf16_gradients_dtypes_and_values"),),
        "the input gradient 0.8% too large (inside the 1e-2 tolerance that test had)",
    ),
    Mutant(
        "dweight_times_weight", "cpu/kernels.py",
        "dw[j] += g[j] * buf[j]\n                g[j] = g[j] * w32[j]",
        "dw[j] += g[j] * buf[j] * w32[j]\n                g[j] = g[j] * w32[j]",
        (("tests/test_autograd.py", "-k", "test_module_training_step"),),
        "fp32 dweight multiplied by the weight (all ones in that test before: invisible)",
    ),
    Mutant(
        "triton_dx_drops_projection", "triton/kernels.py",
        "ds = rstd * (g - xhat * _mean(_row_sum(g * xhat), n_cols, CD))",
        "ds = rstd * g",
        (("tests/test_triton_interpret.py", "-k", "test_public_api_through_the_triton_launchers"),),
        "Triton backward without the projection term (one-block rows), through the op stack",
    ),
    Mutant(
        "dweight_order_by_threads", "cpu/launch.py",
        "return max(16, -(-rows // 256))",
        "return max(16, -(-rows // (8 * torch.get_num_threads())))",
        (("tests/test_autograd.py", "-k", "test_dweight_deterministic_across_runs_and_threads"),),
        "dweight's row blocks (its reduction order) depend on the thread count",
    ),
)

# Which numba caches a change to a file invalidates (cache files are named after their module): those
# of the kernel modules that import it, directly or not (their DEPENDENCIES_SHA256), and its own.
_CORE_KERNELS = ("kernels.", "fusion_kernels.")
_NUMBA_DEPENDENTS = {
    **{f"cpu/{name}.py": _CORE_KERNELS for name in ("runtime", "intrinsics", "cascade", "stages", "kernels")},
    "cpu/fusion_kernels.py": ("fusion_kernels.",),
}


def check(mutant: Mutant, src_root: Path) -> str:
    """The text of ``mutant``'s file under ``src_root`` (``.../src``), whose target must occur once."""
    text = (src_root / "dsnorm" / mutant.file).read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: its target occurs {count} times in {mutant.file} (want 1): "
                         "update the mutant to the current source")
    return text


def apply(mutant: Mutant, src_root: Path) -> None:
    """Apply ``mutant`` to the package under ``src_root``."""
    text = check(mutant, src_root)
    (src_root / "dsnorm" / mutant.file).write_text(text.replace(mutant.old, mutant.new))


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for part in ("src", "tests"):
        shutil.copytree(ROOT / part, dest / part, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _run_tests(copy: Path, cache: Path, tests: tuple) -> tuple[str, str, str]:
    """Run ``tests`` against ``copy``; returns (outcome, first failing test, output tail), the outcome
    "pass", "killed: <assertion type>", or "broke: <exception type or pytest's exit status>"."""
    outcomes = copy.parent / "outcomes.jsonl"
    outcomes.unlink(missing_ok=True)
    plugins = copy.parent / "plugins"  # the plugin alone on the path: nothing else of benchmarks/ shadows
    plugins.mkdir(exist_ok=True)
    shutil.copy2(ROOT / "benchmarks" / "mutant_outcomes.py", plugins)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(copy / "src"), str(plugins))),
               NUMBA_CACHE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1", DSNORM_MUTANT_OUTCOMES=str(outcomes))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "mutant_outcomes",
           *_DESELECT, *tests]
    proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    records = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    imported = [r["dsnorm"] for r in records if "dsnorm" in r]
    # An editable install of another checkout would test that checkout, not the mutated copy.
    if imported and imported[0] and not Path(imported[0]).is_relative_to(copy / "src"):
        raise SystemExit(f"pytest imported dsnorm from {imported[0]}, not from the copy {copy / 'src'}")
    failures = [r for r in records if "test" in r]
    if failures:
        f = failures[0]  # -x: the first failure stops the run
        kind = "killed" if all(r["assertion"] for r in failures) else "broke"
        return f"{kind}: {f['type']}", f"{f['test']} ({f['when']})", out[-3000:]
    if proc.returncode == 0:
        return "pass", "", out[-3000:]
    return f"broke: pytest exited {proc.returncode}", "", out[-3000:]  # interrupted, usage error, none collected


def _baseline_selections(selections) -> list:
    """The selections merged by their files: ``-k a`` and ``-k b`` on one file become ``-k (a) or (b)``
    (a selection without -k takes the whole files)."""
    merged: dict = {}
    for tests in selections:
        files = tuple(a for a in tests if a.startswith("tests/"))
        k = tests[tests.index("-k") + 1] if "-k" in tests else None
        merged.setdefault(files, []).append(k)
    out = []
    for files, ks in merged.items():
        if None in ks:
            out.append(files)
        else:
            out.append((*files, "-k", " or ".join(f"({k})" for k in dict.fromkeys(ks))))
    return out


def _drop_caches(cache: Path, prefixes: tuple) -> None:
    for f in cache.rglob("*"):
        if f.is_file() and f.name.startswith(prefixes):
            f.unlink()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant (repeatable)")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTANTS}
    if args.list:
        for m in MUTANTS:
            tests = " | ".join(" ".join(s) for s in m.selections)
            print(f"{m.name:36} {m.file:22} {tests}\n{'':36} {m.what}")
        return 0
    unknown = set(args.only or ()) - names
    if unknown:
        parser.error(f"unknown mutant(s) {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]

    rows, failures = [], 0
    with tempfile.TemporaryDirectory(prefix="dsnorm-mutants-") as tmp:
        tmp = Path(tmp)
        copy, warm = tmp / "copy", tmp / "numba-warm"
        warm.mkdir()
        _copy_tree(copy)
        for m in chosen:  # every target checked before anything runs
            check(m, copy / "src")
        # The baseline: each selection passes unmutated (and fills the warm cache); one pytest
        # process per set of files, its -k expressions joined (a cold compile shared).
        for tests in _baseline_selections(s for m in chosen for s in m.selections):
            start = time.perf_counter()
            outcome, first, tail = _run_tests(copy, warm, tests)
            print(f"baseline {' '.join(tests)}: {outcome} {first} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if outcome != "pass":
                print(tail)
                return 2
        for m in chosen:
            shutil.rmtree(copy)
            _copy_tree(copy)  # the same path each time: the warm cache's locations stay valid
            apply(m, copy / "src")
            cache = tmp / "numba"
            shutil.rmtree(cache, ignore_errors=True)
            shutil.copytree(warm, cache)
            _drop_caches(cache, _NUMBA_DEPENDENTS.get(m.file, ()))
            for tests in m.selections:  # the numba cache the first selection fills serves the next
                start = time.perf_counter()
                outcome, first, tail = _run_tests(copy, cache, tests)
                seconds = time.perf_counter() - start
                outcome = "SURVIVED" if outcome == "pass" else outcome
                failures += not outcome.startswith("killed")
                rows.append((m.name, " ".join(tests), outcome, first, seconds))
                print(f"{m.name}: {outcome} {first} ({seconds:.0f} s)", flush=True)
                if outcome.startswith("broke"):
                    print(tail, flush=True)

    header = ("mutant", "tests run", "result", "first failing test")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(4)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)) + " | time")
    print("-|-".join("-" * w for w in widths) + "-|-----")
    for r in rows:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r[:4], widths)) + f" | {r[4]:.0f} s")
    print(f"\n{len(rows) - failures} of {len(rows)} selections killed their mutant by an assertion")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
