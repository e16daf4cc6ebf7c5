"""Memory dsnorm keeps between calls, and releasing it (:func:`empty_cache`).

Only the CPU allocator (:mod:`dsnorm.cpu.alloc`) keeps any: the blocks of freed large outputs, for
the next output of their size. This module does not import it, so ``import dsnorm`` loads no part
of the CPU package.
"""

from __future__ import annotations

import sys


def empty_cache() -> int:
    """Free the memory of freed CPU outputs that dsnorm keeps for reuse (outputs of 4 MiB or more:
    at most 4 blocks, 512 MiB in all) and return the number of bytes freed: 0 where no such output
    was made in this process."""
    alloc = sys.modules.get("dsnorm.cpu.alloc")
    return 0 if alloc is None else alloc.empty_cache()
