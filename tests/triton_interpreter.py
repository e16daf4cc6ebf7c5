"""Switching Triton's interpreter on for a test module (shared by the interpreter test modules).

``TRITON_INTERPRET`` is read when a function is decorated by ``@triton.jit``, and Triton's own
library is decorated when ``triton`` is first imported: the variable must be set before that
import. See tests/test_triton_interpret.py's docstring for the reload dance that follows.
"""

import os
import sys

import pytest


def restore_interpret(prior):
    if prior is None:  # leave the variable as the module found it
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prior


def interpreted_triton():
    """Import triton with the interpreter on; skip the calling module where that cannot work.

    Returns ``(triton, prior_value_of_TRITON_INTERPRET, triton_was_already_imported)``.
    """
    prior = os.environ.get("TRITON_INTERPRET")
    preimported = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError:
        restore_interpret(prior)
        pytest.skip("triton is not installed (the GPU extra: pip install dsnorm[gpu])", allow_module_level=True)
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        # Measured with Triton 3.6 (the GPU image's): its interpreter cannot run a Python ``range``
        # whose bounds are kernel values (``for row in range(row_begin, row_end)``: "TypeError:
        # only 0-dimensional arrays can be converted to Python scalars"); the compiler can, and
        # test_triton_compile.py compiles these kernels with 3.6 too.
        restore_interpret(prior)
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over kernel-valued range bounds "
                    "(needs the 3.9 interpreter)", allow_module_level=True)
    return triton, prior, preimported


def ptxas_available() -> bool:
    """Whether Triton's NVIDIA backend (with its bundled ptxas) can compile ahead of time here."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except Exception:
        return False
    return True


def run_compiled(script: str) -> None:
    """Run a compile script in a fresh interpreter, so that Triton is imported compiled even when
    an interpreter module ran in this process; the script prints "ALL OK" when every check held."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    # The scripts import the shared compile helper (tests/triton_aot.py).
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stderr[-4000:]
