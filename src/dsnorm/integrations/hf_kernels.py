"""dsnorm as a Hugging Face ``kernels`` layer: ``kernelize(model, mode=...)`` with dsnorm's mapping
replaces the forward of every ``"RMSNorm"`` layer (transformers' ``DeepseekV3RMSNorm`` and
``DeepseekV32RMSNorm`` among them) by dsnorm's, bit for bit (``cast="hf"``).

The layer comes from a local repository shipped inside this package (no hub): cpu, and cuda
(untested until a GPU runs it), for inference, training and ``Mode.TORCH_COMPILE``.
Needs ``pip install 'dsnorm[kernels]'``.
"""

from __future__ import annotations

from pathlib import Path

from dsnorm.integrations import require

_kernels = require("kernels", "kernels", "dsnorm.integrations.hf_kernels")

REPO_PATH = Path(__file__).with_name("hf_kernel_repo")
LAYER_NAME = "RMSNorm"


def repository():
    """The ``kernels.LocalLayerRepository`` of dsnorm's ``RMSNorm`` layer."""
    return _kernels.LocalLayerRepository(REPO_PATH, layer_name=LAYER_NAME)


def mapping() -> dict:
    """``{"RMSNorm": {device: repository}}`` for cpu and cuda (every mode: the layer serves
    inference, training and torch.compile alike), for ``kernels.use_kernel_mapping`` or
    ``kernels.register_kernel_mapping``."""
    repo = repository()
    return {LAYER_NAME: {"cpu": repo, "cuda": repo}}


def kernelize(model, *, mode=None, device=None):
    """``kernels.kernelize(model, mode=mode, device=device)`` under dsnorm's :func:`mapping`
    (``mode`` defaults to ``Mode.INFERENCE``); returns the model. Layers of other names keep their
    forward; an ``"RMSNorm"`` layer that cannot take dsnorm's raises instead of keeping its own."""
    mode = _kernels.Mode.INFERENCE if mode is None else mode
    with _kernels.use_kernel_mapping(mapping()):
        return _kernels.kernelize(model, mode=mode, device=device, use_fallback=_kernels.KernelizeFallback.NO_LAYER)
