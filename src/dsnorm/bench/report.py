"""The text report of a result (:func:`format_table`): by default one line per case, with ``--full``
every provider of every case; a number timed under contention carries :data:`CONTENDED_MARK`, a
ratio involving a noisy median :data:`NOISY_MARK`."""

from __future__ import annotations

from dsnorm.bench.providers import COMPILED, COMPOSITION, DSNORM, FLOOR, REFERENCE
from dsnorm.bench.registry import PROVIDERS
from dsnorm.bench.timing import NOISY_RATIO, _held
from dsnorm.terminal import split_table, wrap


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


# How the C allocator treats a freed output of tens of MB, which the allocating rows' peers pay for.
_ALLOCATOR_NOTES = {
    "glibc": "glibc maps a block over 32 MiB afresh for every call and unmaps it when it is freed",
    "jemalloc": "jemalloc returns freed blocks that large to the OS soon after",
    "tcmalloc": "tcmalloc keeps freed blocks and hands them out again",
}


def _allocation_note(m: dict) -> list:
    """What the allocating rows measure besides the kernels, for the run's allocator."""
    name = m.get("allocator")
    if m.get("device") != "cpu" or name is None:
        return []
    how = _ALLOCATOR_NOTES.get(name, f"{name}: how it recycles freed blocks is not known here")
    return wrap(f"allocation ({name}): a peer's outputs of MBs come from the allocator ({how}; fresh pages are "
                "faulted in and zeroed, inside its time); dsnorm's of 4 MiB or more from blocks it recycles "
                "(dsnorm.empty_cache frees them)", "  ")


def _allocation_split(result: dict) -> list:
    """Each allocating fused case beside the in-place case of its rows: the in-place form moves the
    same bytes into its inputs, so the difference is what fresh outputs cost. Shown where it
    exceeds the spread of the two dsnorm rows (median - fastest call, the larger)."""
    def dsnorm_row(case):
        return next((p for p in case["providers"] if p["role"] == "dsnorm" and p["median_ms"] is not None), None)

    def rows_width(case):
        shape = case.get("shape") or [0]
        return (max(1, _prod(shape[:-1])), shape[-1], case.get("dtype"))

    in_place = {rows_width(c): c for c in result["cases"] if c.get("form") == "in-place" and dsnorm_row(c)}
    lines = []
    for case in result["cases"]:
        # The core fused form only: a fusion of the same shape (fp8, final norm) does other work.
        partner = in_place.get(rows_width(case)) if case.get("form") == "fused" and case.get("site") != "fusion" \
            else None
        a = dsnorm_row(case)
        if partner is None or a is None or case.get("direction", "forward") != "forward":
            continue
        b = dsnorm_row(partner)
        spread = max(a["median_ms"] - a["min_ms"], b["median_ms"] - b["min_ms"])
        extra = a["median_ms"] - b["median_ms"]
        if abs(extra) > spread:
            lines += wrap(f"  {case['name']}: {_fmt_time(a['median_ms'])} = {_fmt_time(b['median_ms'])} in place "
                          f"({partner['name']}) {'+' if extra > 0 else '-'} {_fmt_time(abs(extra))} for its fresh "
                          f"outputs (spread {_fmt_time(spread)})", "      ")
    return ["allocating against in place (the same bytes moved; the difference is the outputs):"] + lines \
        if lines else []


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _header(result: dict) -> list:
    m = result["machine"]
    where = f"{m['gpu']}, host " if m.get("gpu") else ""
    alloc = f", allocator {m['allocator']}" if m.get("allocator") and m.get("device") == "cpu" else ""
    lines = wrap(f"dsnorm bench on {where}{m['cpu']} ({m['device']}, {m['threads']} threads, capability "
                 f"{m['cpu_capability']}{alloc}); torch {m['torch']}, numba {m['numba']}", "  ")
    lines += _allocation_note(m)
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
    lines += wrap("dsnorm: median time per call, and its GB/s (byte model: dsnorm.bench.cases.case_bytes) as a "
                  "share of the copy bandwidth (decode inputs stay in cache: it can pass 100); check: dsnorm "
                  "against the reference (every provider's fidelity with --full); vs X: time of X / time of dsnorm (> 1: dsnorm faster; "
                  f"vs the torch.add floor < 1 is expected); {labels}.")
    lines += _allocation_split(result)
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
    lines.append("GB/s counts the bytes of the byte model (dsnorm.bench.cases.case_bytes); decode-sized inputs")
    lines.append("stay in cache, so their %copy (copy bandwidth is a DRAM figure) can exceed 100.")
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
