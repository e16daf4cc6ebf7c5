"""Record the golden set from the current code, once per CPU capability torch can be lowered to.

    PYTHONPATH=src python tests/golden/record.py          # re-record golden.json, print what changed
    PYTHONPATH=src python tests/golden/record.py --check  # compare under this process's capability

Each capability is recorded in a fresh process with ``ATEN_CPU_CAPABILITY`` set (torch reads it
once, at start-up; it can only lower the capability). A case whose result is the same under all
of them is stored once (``result``), any other per capability (``by_capability``).
``--check`` prints a JSON summary of the cases that differ from the record and exits 1 if any do:
``tests/test_golden.py`` runs it in a subprocess on a machine whose capability has no record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden.json"
# The capabilities recorded: every x86 machine can lower torch to these (ATEN_CPU_CAPABILITY).
CAPABILITIES = ("avx2", "default")

sys.path.insert(0, str(HERE.parent))
from golden import cases  # noqa: E402


def load() -> dict:
    return json.loads(GOLDEN.read_text())


def dump(golden: dict) -> str:
    # One case per line, so that a re-record's diff shows the cases that changed.
    lines = ["{", f'"meta": {json.dumps(golden["meta"], sort_keys=True)},', '"cases": [']
    lines += [json.dumps(c, sort_keys=True) + ("," if i < len(golden["cases"]) - 1 else "")
              for i, c in enumerate(golden["cases"])]
    return "\n".join(lines + ["]", "}", ""])


def emit(path: str) -> None:
    import torch

    recipes = cases.space()
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "results": cases.run_all(recipes)}
    Path(path).write_text(json.dumps(out))


def check() -> int:
    import torch

    golden = load()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in golden["meta"]["capabilities"]:
        print(json.dumps({"capability": capability, "error": "no record for this capability"}))
        return 2
    results = cases.run_all([c["recipe"] for c in golden["cases"]])
    diffs = cases.differences(golden, results, capability)
    print(json.dumps({"capability": capability, "cases": len(results),
                      "differences": [list(d) for d in diffs]}))
    return 1 if diffs else 0


def record() -> None:
    import numba
    import torch

    per_cap = {}
    for cap in CAPABILITIES:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
            subprocess.run([sys.executable, __file__, "--emit", path], env=env, check=True)
            got = json.loads(Path(path).read_text())
        per_cap[got["capability"]] = got["results"]
        print(f"recorded {len(got['results'])} cases under {got['capability']}")
    caps = sorted(per_cap)
    recipes = cases.space()
    new_cases = []
    for i, recipe in enumerate(recipes):
        results = {cap: per_cap[cap][i] for cap in caps}
        if all(r == results[caps[0]] for r in results.values()):
            new_cases.append({"recipe": recipe, "result": results[caps[0]]})
        else:
            new_cases.append({"recipe": recipe, "by_capability": results})
    # The code recorded: the last commit that changed src/ (and whether src/ has changes on top).
    git = ["git", "-C", str(HERE)]
    commit = subprocess.run([*git, "log", "-1", "--format=%h", "--", "../../src"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "../../src"], capture_output=True,
                           text=True).stdout.strip()
    golden = {"meta": {"capabilities": caps, "src_commit": commit + ("+changes" if dirty else ""),
                       "torch": torch.__version__,
                       "numba": numba.__version__, "count": len(new_cases),
                       "recorded": datetime.date.today().isoformat()},
              "cases": new_cases}
    if GOLDEN.exists():
        old = load()
        old_by_recipe = {json.dumps(c["recipe"], sort_keys=True): c for c in old["cases"]}
        changed = [c for c in new_cases if json.dumps(c["recipe"], sort_keys=True) in old_by_recipe
                   and old_by_recipe[json.dumps(c["recipe"], sort_keys=True)] != c]
        new_keys = {json.dumps(c["recipe"], sort_keys=True) for c in new_cases}
        added = len(new_keys - set(old_by_recipe))
        removed = len(set(old_by_recipe) - new_keys)
        print(f"against the previous record: {len(changed)} changed, {added} added, {removed} removed")
        for c in changed[:20]:
            print("  changed:", json.dumps(c["recipe"], sort_keys=True))
    split = sum("by_capability" in c for c in new_cases)
    print(f"{len(new_cases)} cases, {split} of them differ between {', '.join(caps)}")
    GOLDEN.write_text(dump(golden))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emit", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.emit:
        emit(args.emit)
        return 0
    if args.check:
        return check()
    record()
    return 0


if __name__ == "__main__":
    sys.exit(main())
