"""The golden set: thousands of calls through dsnorm's public API (functions, module, ops, in
place, fusions, backward; every dtype, option, layout and special value, empty and bad input),
recorded from the code at commit 34aa74b and compared bit for bit (a sha256 of each output's raw
bytes, its shape, dtype and strides; or the exception's type and message). A refactor that
changes any result, or any error message, fails here with the recipes of the cases that changed.

Recorded per CPU capability (``tests/golden/record.py``). dsnorm's bits are torch's reference's,
whose fp32 sum order follows torch's CPU capability; on a machine whose capability has no record
(e.g. AVX512) the comparison runs in a subprocess with ``ATEN_CPU_CAPABILITY`` lowered to a
recorded one. Re-record (and say why in the commit) only when a change of results is intended:
``PYTHONPATH=src python tests/golden/record.py``.
"""

import collections
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from golden import cases

RECORD = Path(__file__).parent / "golden" / "record.py"
GOLDEN = json.loads((Path(__file__).parent / "golden" / "golden.json").read_text())
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _report(diffs: list, capability: str) -> str:
    kinds = collections.Counter(recipe["kind"] for _, recipe, _, _ in diffs)
    meta = GOLDEN["meta"]
    lines = [f"{len(diffs)} of {len(GOLDEN['cases'])} golden cases changed under {capability} "
             f"(by kind: {dict(kinds)}; recorded from src at {meta['src_commit']} with torch {meta['torch']}, "
             f"now torch {torch.__version__}); the first of them:"]
    for i, recipe, want, got in diffs[:25]:
        lines += [f"case {i}: {json.dumps(recipe, sort_keys=True)}", f"  recorded: {json.dumps(want, sort_keys=True)}",
                  f"  now:      {json.dumps(got, sort_keys=True)}"]
    return "\n".join(lines)


def test_record_holds_the_current_space():
    # The recipes stored are the ones cases.space() builds: a case added to the space without a
    # re-record would otherwise never be compared.
    assert [c["recipe"] for c in GOLDEN["cases"]] == cases.space(), "re-record: tests/golden/record.py"


def test_recorded_errors_left_inputs_untouched():
    # Part of the record, so checked on it: each refusal left every input's bits and version as
    # they were, and only the in-place forms changed their inputs when they succeeded.
    for case in GOLDEN["cases"]:
        for result in ([case["result"]] if "result" in case else case["by_capability"].values()):
            if "raises" in result:
                assert result["inputs_untouched"], case["recipe"]
            elif not case["recipe"]["api"].endswith("fused_add_rms_norm_"):
                assert result["inputs_changed"] == [], case["recipe"]


def _release(version: str) -> str:
    return version.split("+")[0]  # 2.13.0+cpu and a CUDA build's 2.13.0 are one release


def test_golden_results_unchanged():
    # A refactor guard, not a fidelity test: some recorded messages are torch's own (its dispatcher's
    # refusals), which another torch release words differently. The rest of the suite holds every
    # torch release to the reference; CI installs the recorded one, so there this always runs.
    recorded_torch = GOLDEN["meta"]["torch"]
    if _release(torch.__version__) != _release(recorded_torch):
        pytest.skip(f"the golden set was recorded with torch {recorded_torch}; this is torch "
                    f"{torch.__version__} (re-record with tests/golden/record.py to compare here)")
    capability = torch.backends.cpu.get_cpu_capability()
    recorded = GOLDEN["meta"]["capabilities"]
    if capability in recorded:
        results = cases.run_all([c["recipe"] for c in GOLDEN["cases"]])
        diffs = cases.differences(GOLDEN, results, capability)
    elif X86:
        # torch reads ATEN_CPU_CAPABILITY once, at start-up, and can always lower itself to one of
        # these on x86: compare in a fresh process there.
        lowered = next(c for c in ("AVX2", "DEFAULT") if c in recorded)
        env = {**os.environ, "ATEN_CPU_CAPABILITY": lowered.lower()}
        proc = subprocess.run([sys.executable, str(RECORD), "--check"], env=env, capture_output=True, text=True)
        assert proc.stdout.strip(), proc.stderr[-4000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["capability"] == lowered, summary
        capability, diffs = lowered, summary["differences"]
    else:
        pytest.skip(f"the golden set is recorded on x86 ({', '.join(recorded)}); this machine is "
                    f"{platform.machine()} ({capability}), whose fp32 sum order may differ")
    assert not diffs, _report(diffs, capability)
