"""benchmarks/mutants.py stays applicable: every mutant's target text occurs exactly once in the
current source, the mutated file still parses, and its tests name files that exist. (The script
itself runs outside CI: each mutant recompiles kernels.)"""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mutants.py"
PACKAGE = ROOT / "src" / "dsnorm"


def _mutants():
    spec = importlib.util.spec_from_file_location("dsnorm_mutants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up there
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


def test_the_list_covers_what_it_must():
    names = [m.name for m in MUTANTS]
    assert len(names) >= 12 and len(set(names)) == len(names)
    files = {m.file for m in MUTANTS}
    assert {"cpu/stages.py", "cpu/fusion_kernels.py", "ops.py", "triton/kernels.py", "triton/fusions.py"} <= files


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_to_the_current_source(mutant):
    text = (PACKAGE / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.name}: the target must occur once in {mutant.file}"
    assert mutant.new != mutant.old
    ast.parse(text.replace(mutant.old, mutant.new))
    assert mutant.selections
    for tests in mutant.selections:
        paths = [a.split("::")[0] for a in tests if a.startswith("tests/")]
        assert paths and all((ROOT / p).is_file() for p in paths), tests
