"""dsnorm inside other engines, through their own extension points (each module needs its extra).

* :mod:`dsnorm.integrations.vllm`: the ``dsnorm`` provider of vLLM's ``rms_norm`` and
  ``fused_add_rms_norm`` IR ops (``pip install 'dsnorm[vllm]'``), registered by the
  ``vllm.general_plugins`` entry point.
* :mod:`dsnorm.integrations.hf_kernels`: a Hugging Face ``kernels`` layer for ``"RMSNorm"``
  (``pip install 'dsnorm[kernels]'``).

Importing :mod:`dsnorm` imports none of these; importing one without its engine raises an
ImportError naming the extra.
"""

from __future__ import annotations

import importlib


def require(module: str, extra: str, what: str):
    """``importlib.import_module(module)``, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {module!r}: pip install 'dsnorm[{extra}]' ({e})") from e
