"""numba's thread pool across ``fork``: whether this process is a forked child that must not use it.

numba's GNU OpenMP pool cannot serve a forked child (numba terminates the child, SIGTERM, on its
first parallel launch), so a child of a process whose pool ran sets ``forked_after_pool`` and
:mod:`dsnorm.cpu` runs every call there on the calling thread (torch's DataLoader workers use one
thread anyway; numba's tbb and workqueue layers are fork-safe). The handler is registered when
dsnorm is imported (:mod:`dsnorm.ops` imports this module), not when :mod:`dsnorm.cpu` is (on first
use), so that a pool started by other code before that is seen too. Imports neither numba nor
torch.
"""

from __future__ import annotations

import os
import sys

forked_after_pool = False


def _after_fork_in_child() -> None:
    global forked_after_pool
    numba = sys.modules.get("numba")
    if numba is None:  # numba not imported: no pool can have run
        return
    try:
        layer = numba.threading_layer()
    except ValueError:  # no pool ran in the parent: the child starts its own
        return
    if layer == "omp":
        from numba.np.ufunc import omppool

        forked_after_pool = omppool.openmp_vendor == "GNU"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
