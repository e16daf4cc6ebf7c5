"""Fresh CPU outputs (:func:`empty_output`): large ones on huge pages and recycled, mid-sized ones
kept in glibc's heap between calls. Self-contained: torch, numpy and the C library only.

* Huge pages: a fresh output of hundreds of MB costs more in first-touch page faults (4 KiB each)
  than the kernel costs in arithmetic. Where transparent huge pages are in "madvise" mode, advising
  the fresh buffer before its first touch lets the kernel fault it in 2 MiB pages.
* Recycling: even in huge pages, a fresh mapping costs the OS's zeroing of every page on first
  touch, and glibc and jemalloc hand blocks this large back to the OS when they are freed, so every
  allocating call paid that zeroing again (tcmalloc keeps them, and there the call cost what it does
  in recycled memory). Large outputs therefore come from blocks of dsnorm's own, and a block whose
  output has been freed is kept, bounded, for the next output of its size: an allocating call then
  costs about what the in-place form does, whatever the C allocator (docs/performance.md).
* The heap: mid-sized outputs (64 KiB to 32 MiB) come from glibc's heap, not from mmap, once glibc
  has seen a freed block that large, and glibc hands the top of its heap back to the OS whenever
  more than its trim threshold (twice that block) lies free there. A fused call frees two or more
  such outputs together, which can exceed the threshold: then every call returns the pages and
  faults them back in (a call then costs several times as much, depending on the heap's layout).
  One freed block of ``_PRIME_OUTPUTS`` times an output's size raises glibc's thresholds above what
  a call frees, the adjustment glibc makes by itself when a program frees such a block; the block is
  not written (unless torch.use_deterministic_algorithms fills new memory), so it costs an
  mmap/munmap once per new largest size. Outputs stay separate fresh tensors.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np
import torch

_HUGE_PAGE = 2 << 20
_ADVISE_BYTES = 4 << 20
_MADV_HUGEPAGE = 14


def _make_libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        return madvise
    except (OSError, AttributeError):  # not Linux/glibc: plain pages
        return None


_madvise = _make_libc()

# The smallest output the heap is primed for; smaller ones need none of this module's care.
PRIME_MIN_BYTES = 64 << 10
# glibc adjusts its thresholds only for freed blocks up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX)
# including its own header, so the largest useful block stays a little below that.
_PRIME_MAX_BYTES = (32 << 20) - (64 << 10)
_PRIME_OUTPUTS = 4
_primed_bytes = 0


def _prime_heap(nbytes: int) -> None:
    global _primed_bytes
    block = min(_PRIME_OUTPUTS * nbytes, _PRIME_MAX_BYTES)
    if block > _primed_bytes:
        torch.empty(block, dtype=torch.uint8)  # freed at once
        _primed_bytes = block


class _Pool:
    """The blocks of freed large outputs, kept for the next output of the same size.

    At most ``MAX_BLOCKS`` blocks and ``MAX_BYTES`` in all (the oldest goes first): enough for the
    outputs of two fused calls, which is what a model's chain of blocks frees and asks for again.
    :func:`empty_cache` frees them all. A block comes back from whichever thread drops an output's
    last reference, and also from the garbage collector, which may run inside any allocation,
    this pool's own included, while its lock is held: so a returned block is only appended to
    ``_returned`` (atomic, no lock), and moved into the pool under the lock by the next pool call
    (take, give or clear).
    """

    MAX_BLOCKS = 4
    MAX_BYTES = 512 << 20

    def __init__(self) -> None:
        self._free: list = []  # (data size rounded to huge pages, allocation), oldest first
        self._returned: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def _settle(self) -> None:
        # Under the lock. A block returned meanwhile (the GC, another thread) waits for the next call.
        while self._returned:
            self._free.append(self._returned.popleft())
        while len(self._free) > self.MAX_BLOCKS or sum(s for s, _ in self._free) > self.MAX_BYTES:
            del self._free[0]

    def take(self, size: int):
        with self._lock:
            self._settle()
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i][0] == size:
                    return self._free.pop(i)[1]
        return None

    def give(self, size: int, raw: torch.Tensor) -> None:
        self._returned.append((size, raw))
        if self._lock.acquire(blocking=False):  # else its holder settles it, or the next call does
            try:
                self._settle()
            finally:
                self._lock.release()

    def after_fork_in_child(self) -> None:
        # Another thread may have held the lock when the process forked: the child's copy of it
        # would never be released. The blocks themselves are the child's own copies.
        self._lock = threading.Lock()

    def clear(self) -> int:
        with self._lock:
            self._settle()
            freed = sum(raw.nbytes for _, raw in self._free)
            self._free.clear()
        return freed


_POOL = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.after_fork_in_child)


class _Block:
    """One output's bytes as numpy sees them: the array made from it (which the output's storage
    holds) keeps the allocation alive, and when that array goes, the allocation goes to the pool."""

    __slots__ = ("raw", "size", "pool", "__array_interface__")

    def __init__(self, raw: torch.Tensor, size: int, start: int, nbytes: int, pool: _Pool) -> None:
        self.raw, self.size, self.pool = raw, size, pool
        self.__array_interface__ = {"data": (start, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self.pool.give(self.size, self.raw)


def empty_cache() -> int:
    """Free the memory of freed outputs that dsnorm keeps for reuse on the CPU (outputs of 4 MiB
    or more: at most 4 blocks, 512 MiB in all). Returns the number of bytes freed."""
    return _POOL.clear()


def empty_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh, contiguous, uninitialised CPU tensor of ``like``'s shape; large ones start on a
    huge-page boundary, in memory advised for huge pages or recycled from a freed output.

    glibc maps large allocations without 2 MiB alignment, so the unaligned head and tail of an
    advised plain allocation took 4 KiB pages, a large part of a large call's page faults. An
    output of 4 MiB or more is therefore carved out of a block 2 MiB larger than its data rounded up
    to whole huge pages, on the block's first 2 MiB boundary; only the data's whole huge pages are
    advised (a partly used one would hold up to 2 MiB more than the data). The output's storage is
    exactly its data, at offset 0 (made through numpy, whose array keeps the block alive):
    torch.save, pickle and share_memory_ copy a tensor's whole storage, and with the block's storage
    they copied the slack too. Like that of any tensor made from numpy, such a storage cannot be
    resized: ``resize_`` of the tensor to more elements raises (shrinking works), and so does
    ``untyped_storage().resize_(0)`` (to free it early, drop the references or swap ``y.data``).
    """
    nbytes = like.numel() * dtype.itemsize
    if nbytes >= PRIME_MIN_BYTES and _primed_bytes < min(_PRIME_OUTPUTS * nbytes, _PRIME_MAX_BYTES):
        _prime_heap(nbytes)
    if _madvise is None or nbytes < _ADVISE_BYTES or _fills_new_memory():
        if like.is_contiguous():
            return torch.empty_like(like) if like.dtype is dtype else torch.empty_like(like, dtype=dtype)
        return torch.empty(like.shape, dtype=dtype)
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    raw = _POOL.take(size)
    fresh = raw is None
    if fresh:
        raw = torch.empty(size + _HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr()
    start = -(-base // _HUGE_PAGE) * _HUGE_PAGE
    if fresh:
        _madvise(start, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)  # advice only: may be refused
    data = np.asarray(_Block(raw, size, start, nbytes, _POOL))
    # set_ on the storage, not .view(dtype): the output is no view (no _base for autograd to
    # rebase in-place ops onto).
    return torch.empty(0, dtype=dtype).set_(torch.from_numpy(data).untyped_storage(), 0, like.shape)


def _fills_new_memory() -> bool:
    # torch.use_deterministic_algorithms(True) fills every new tensor (NaN): it would write the
    # slack too, before the advice. Then a plain allocation, as torch makes it.
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
