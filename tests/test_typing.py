"""dsnorm ships py.typed: a user's strictly type-checked code sees the public API's real types."""

import os
import subprocess
import sys

import pytest

import dsnorm

HERE = os.path.dirname(os.path.abspath(__file__))


def _clean_env() -> dict:
    # mypy finds packages on the interpreter's site paths, not on PYTHONPATH: resolve dsnorm the same way.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}


def test_strict_mypy_sees_the_public_api_types(tmp_path):
    pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")
    found = subprocess.run(
        [sys.executable, "-c", "import dsnorm; print(dsnorm.__file__)"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True,
    ).stdout.strip()
    if not found or os.path.realpath(found) != os.path.realpath(dsnorm.__file__):
        pytest.skip(f"mypy would read the installed dsnorm ({found or 'none'}), not the one under test "
                    f"({dsnorm.__file__}): install this tree (pip install -e .)")
    # Run from an empty directory: no project config, as in a user's checkout.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
         os.path.join(HERE, "typed_usage.py")],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
