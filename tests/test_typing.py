"""dsnorm ships py.typed: a user's strictly type-checked code sees the public API's real types."""

import os
import subprocess
import sys

import pytest

import dsnorm

HERE = os.path.dirname(os.path.abspath(__file__))


def test_strict_mypy_sees_the_public_api_types(tmp_path):
    pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")
    # mypy resolves dsnorm on the interpreter's path (site-packages, PYTHONPATH) from where it runs:
    # make sure that is the tree these tests import.
    found = subprocess.run(
        [sys.executable, "-c", "import dsnorm; print(dsnorm.__file__)"], cwd=tmp_path, capture_output=True, text=True,
    ).stdout.strip()
    if not found or os.path.realpath(found) != os.path.realpath(dsnorm.__file__):
        pytest.skip(f"mypy would read the installed dsnorm ({found or 'none'}), not the one under test "
                    f"({dsnorm.__file__}): install this tree (pip install -e .)")
    # From an empty directory and with no config file at all (neither a project's nor the user's
    # ~/.config/mypy/config), so that only --strict decides.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--config-file", "",
         "--cache-dir", str(tmp_path / "cache"), os.path.join(HERE, "typed_usage.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _public_callables():
    import inspect

    from dsnorm import checkpoint, distributed, output_files, patching, sites

    for module in (dsnorm, sites, output_files, checkpoint, patching, distributed):
        for name in getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]:
            obj = getattr(module, name)
            if getattr(obj, "__module__", "").startswith("dsnorm") and callable(obj):
                yield f"{module.__name__}.{name}", obj
                if inspect.isclass(obj):
                    for meth in ("__init__", "__call__", "forward"):
                        if meth in vars(obj):
                            yield f"{module.__name__}.{name}.{meth}", vars(obj)[meth]


def test_annotations_evaluate_at_run_time():
    # Tools evaluate annotations (typing.get_type_hints: pydantic, Sphinx, TorchScript of a subclass):
    # every name they use must exist when the program runs, not only under TYPE_CHECKING.
    import typing

    seen = 0
    for where, obj in _public_callables():
        try:
            typing.get_type_hints(obj)
        except Exception as e:  # the test's point: say which annotation and why
            raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
        seen += 1
    assert seen > 40, seen
