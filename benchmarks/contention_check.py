"""``python benchmarks/contention_check.py IDLE.json LOADED.json``: does a loaded run mislead?

Compares two ``dsnorm bench --json`` results of the same cases, one from a quiet machine and one
taken beside other work (two ``python -c 'while True: pass'`` processes, say). Prints, per case,
whether each run marked it contended and the worst ratio of a provider's median in the loaded run
to its median in the idle run. Exit status 1 when the idle run has a contended case, or an
unmarked case of the loaded run has a provider over ``--limit`` (default 2) times slower (the
bench then let a misleading number through unmarked), or a case has no provider timed in both runs.
"""

import argparse
import json
import sys


def medians(case: dict) -> dict:
    return {p["name"]: p["median_ms"] for p in case["providers"] if p.get("median_ms")}


def contended(case: dict) -> bool:
    return bool(case.get("contention") and case["contention"].get("contended"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("idle")
    parser.add_argument("loaded")
    parser.add_argument("--limit", type=float, default=2.0, help="slowdown an unmarked case may show (default 2)")
    args = parser.parse_args(argv)
    idle = {c["name"]: c for c in json.load(open(args.idle))["cases"]}
    loaded = {c["name"]: c for c in json.load(open(args.loaded))["cases"]}
    bad = errors = 0
    print(f"{'case':<36} {'idle':>8} {'loaded':>8} {'worst loaded/idle':>24}")
    for name, case in loaded.items():
        if name not in idle:
            continue
        before, after = medians(idle[name]), medians(case)
        ratios = {p: after[p] / before[p] for p in after if p in before}
        marks = f"{name:<36} {'marked' if contended(idle[name]) else '-':>8} {'marked' if contended(case) else '-':>8} "
        if not ratios:  # nothing to compare is an error, not a pass
            errors += 1
            print(marks + f"{'-':>24}  <-- error: no provider timed in both runs")
            continue
        worst = max(ratios.items(), key=lambda kv: kv[1])
        wrong = (contended(idle[name]) or (not contended(case) and worst[1] > args.limit))
        bad += wrong
        print(marks + f"{worst[1]:>10.2f}x ({worst[0]})" + ("  <-- misleading" if wrong else ""))
    print(f"{bad} case(s) misleading" + (f", {errors} case(s) with nothing to compare" if errors else ""))
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
