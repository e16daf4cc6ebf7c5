"""Triton GPU kernels (``kernels``) and their launchers (``launch``); imported only for CUDA tensors."""
