"""A local Hugging Face ``kernels`` repository (``metadata.json`` beside this file): its ``layers``
module holds dsnorm's ``RMSNorm`` kernel layer. Loaded by ``kernels.LocalLayerRepository``
(see :mod:`dsnorm.integrations.hf_kernels`), which imports it under the id in metadata.json."""

from . import layers  # noqa: F401
