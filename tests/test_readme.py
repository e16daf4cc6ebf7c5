"""README's usage example runs as written (its assertion included) on the CPU."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split(f"## {title}", 1)
    if len(section) < 2:
        pytest.fail(f"README has no section {title!r}")
    blocks = re.findall(r"```python\n(.*?)```", section[1].split("\n## ", 1)[0], flags=re.S)
    if not blocks:
        pytest.fail(f"README's section {title!r} has no python block")
    return blocks[0]


def test_drop_in_example_runs():
    code = _section_code("Use: a drop-in for the reference class")
    assert "reference_norm = " in code  # every name it uses is defined in it
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    x, residual, norm = namespace["x"], namespace["residual"], namespace["norm"]
    assert x.shape == residual.shape == (8, 1, 7168) and norm.weight.shape == (7168,)
