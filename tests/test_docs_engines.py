"""docs/engines.md's examples run as written (the vLLM one is run B of tests/test_vllm_engine.py)."""

import pathlib
import re

import pytest

from conftest import require_extra

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "engines.md"


def _examples(title: str) -> list:
    text = DOC.read_text(encoding="utf-8")
    section = next((s for s in text.split("\n## ")[1:] if s.startswith(title)), None)
    if section is None:
        pytest.fail(f"docs/engines.md has no section {title!r}")
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_every_python_block_is_run_by_a_test():
    # One block per engine: the kernels one below, the vLLM one by the engine test's compiled run.
    assert len(_examples("vLLM")) == 1 and len(_examples("Hugging Face")) == 1
    assert len(re.findall(r"```python", DOC.read_text(encoding="utf-8"))) == 2


def test_kernels_example_runs():
    require_extra("kernels", "kernels")
    pytest.importorskip("transformers")
    namespace: dict = {}
    exec(compile(_examples("Hugging Face")[0], str(DOC), "exec"), namespace)
    model = namespace["model"]
    assert sum("_kernel_repo" in m.__dict__ for m in model.modules()) == 9
