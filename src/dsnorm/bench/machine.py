"""What a run was measured on (the JSON's ``machine``): the CPU, torch's threads, the versions, the
CPU capability torch dispatches to, the C allocator, the GPU (:func:`machine_info`)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Optional

import torch

import dsnorm


def _version(dist: str) -> Optional[str]:
    # importlib.metadata reads the installed metadata without importing the package.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# The allocators a process may have preloaded (LD_PRELOAD) or linked, by their libraries' names.
_ALLOCATOR_LIBRARIES = (("tcmalloc", "libtcmalloc"), ("jemalloc", "libjemalloc"), ("mimalloc", "libmimalloc"))


def allocator() -> str:
    """The C allocator behind this process's ``malloc``: ``tcmalloc``, ``jemalloc`` or ``mimalloc``
    when its library is mapped (``/proc/self/maps``), else ``glibc`` where the C library is glibc,
    else ``other``. It decides what a fresh large output costs: glibc and jemalloc give blocks of
    tens of MB back to the OS when they are freed (the next one is faulted in and zeroed again),
    tcmalloc keeps them."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for name, library in _ALLOCATOR_LIBRARIES:
        if library in maps:
            return name
    return "glibc" if platform.libc_ver()[0] == "glibc" else "other"


def machine_info(device: torch.device) -> dict:
    """``cpu``, ``threads`` (torch's, which dsnorm's kernels follow) and versions (None when not
    installed), plus the CPU capability torch dispatches to and the GPU's name on CUDA."""
    info = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "numba": _version("numba"),
        "triton": _version("triton"),
        "dsnorm": dsnorm.__version__,
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "allocator": allocator(),
        "device": device.type,
        # Timings on a shared machine are only as good as its quiet: the 1-minute load average
        # when the run started is kept with the results.
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        import numba

        # dsnorm's CPU kernels run min(threads, numba_threads) threads.
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    return info


def _numba_threading_layer() -> Optional[str]:
    """The threading layer numba's parallel kernels ran on (None if none ran)."""
    try:
        import numba

        return numba.threading_layer()
    except (ImportError, ValueError):  # ValueError: no parallel kernel has run yet
        return None
