"""The run: every case's providers built, verified and timed (:func:`run_case`; a fusion against its
composition: :func:`run_fusion_case`), and the JSON-ready result of them all (:func:`bench`).

JSON (``--json``): top level ``machine`` (``cpu``, ``threads``, ``torch``, ``numba``, ``triton``
and more), ``copy_gbps``, ``cases``, plus ``fidelity_ok``, ``elapsed_s``, ``compile_startup_s``,
``byte_model``, ``timing`` (in words) and ``settings`` (its numbers), ``input_seed``, ``filters``
(the ``--cases`` / ``--providers`` texts; ``dsnorm bench`` only), ``contention`` (``rule``,
``limits``, ``detectable``, ``settle``: the wait at the start or None, ``copy_contended``,
``cases_contended``); ``machine`` also holds
``numba_threads`` and ``numba_threading_layer`` on CPU, and ``allocator`` (the C allocator:
glibc, tcmalloc, jemalloc, mimalloc or other). Each case: ``name``, ``shape``, ``form``
(plain / fused / in-place), ``providers`` and ``site``, ``direction``, ``layout``, ``bytes``,
``fidelity_rule``, ``contention`` (:func:`~dsnorm.bench.timing.measure_uncontended`'s judgement of
the window kept: ``contended``, ``attempts``, ``seconds``, ``others_cpus``, ``others_share``,
``pressure_share``;
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

import os
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch

from dsnorm import contention
from dsnorm.bench.cases import (
    DTYPE,
    INPUT_SEED,
    PREFILL_TOKENS,
    QUICK_TOKENS,
    Case,
    case_bytes,
    default_cases,
    fusion_cases,
    make_inputs,
)
from dsnorm.bench.machine import _numba_threading_layer, machine_info
from dsnorm.bench.providers import (
    COMPILED,
    COMPOSITION,
    DSNORM,
    FLOOR,
    REFERENCE,
    VLLM,
    Runner,
    Unavailable,
    _const,
    _reference_module,
    find_vllm_so,
    load_vllm,
)
from dsnorm.bench.registry import CUDA_ONLY, PROVIDERS
from dsnorm.bench.timing import (
    DEFAULT,
    NOISY_RATIO,
    QUICK,
    Settings,
    copy_bandwidth,
    graph_call_time,
    measure_uncontended,
    settle,
)
from dsnorm.bench.verify import (
    _outputs_equal,
    compare,
    fidelity_criterion,
    fusion_fidelity_ok,
    max_rel_err,
    meets_fidelity,
)
from dsnorm.ref import EPS, RMSNormRef, rms_norm_backward_ref

JSON_TOP_KEYS = ("machine", "copy_gbps", "cases")
JSON_MACHINE_KEYS = ("cpu", "threads", "torch", "numba", "triton")
JSON_CASE_KEYS = ("name", "shape", "form", "providers")
JSON_PROVIDER_KEYS = (
    "name", "median_ms", "gbps", "pct_copy", "speedup_vs_reference",
    "residual_bitwise", "max_ulp", "pct_bitwise",
)


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
