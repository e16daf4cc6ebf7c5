"""Fresh CPU outputs (:func:`empty_output`): large ones on huge pages, mid-sized ones kept in glibc's
heap between calls. Self-contained: torch and the C library only.

* Huge pages: a fresh output of hundreds of MB costs more in first-touch page faults (4 KiB each)
  than the kernel costs in arithmetic. Where transparent huge pages are in "madvise" mode, advising
  the fresh buffer before its first touch lets the kernel fault it in 2 MiB pages.
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


def empty_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh, contiguous, uninitialised CPU tensor of ``like``'s shape; large ones start on a
    huge-page boundary and are advised for huge pages before their first touch.

    glibc maps large allocations without 2 MiB alignment, so the unaligned head and tail of an
    advised plain allocation took 4 KiB pages, a large part of a large call's page faults. An
    output of 4 MiB or more is therefore carved out of an allocation 2 MiB larger than the data,
    on its first 2 MiB boundary. Only the whole huge pages of the data are advised (a partly used one would hold up
    to 2 MiB more than the data). The output's storage is exactly its data, at offset 0 (made
    through numpy, whose array keeps the allocation alive): torch.save, pickle and share_memory_
    copy a tensor's whole storage, and with the allocation's storage they copied the 2 MiB of
    slack too. Like that of any tensor made from numpy, such a storage cannot be resized:
    ``resize_`` of the tensor to more elements raises (shrinking works), and so does
    ``untyped_storage().resize_(0)`` (to free it early, drop the references or swap ``y.data``).
    """
    nbytes = like.numel() * dtype.itemsize
    if nbytes >= PRIME_MIN_BYTES and _primed_bytes < min(_PRIME_OUTPUTS * nbytes, _PRIME_MAX_BYTES):
        _prime_heap(nbytes)
    if _madvise is None or nbytes < _ADVISE_BYTES or _fills_new_memory():
        if like.is_contiguous():
            return torch.empty_like(like) if like.dtype is dtype else torch.empty_like(like, dtype=dtype)
        return torch.empty(like.shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    base = raw.data_ptr()
    start = -(-base // _HUGE_PAGE) * _HUGE_PAGE
    _madvise(start, nbytes // _HUGE_PAGE * _HUGE_PAGE, _MADV_HUGEPAGE)  # advice only: may be refused
    data = raw.numpy()[start - base:start - base + nbytes]  # a numpy view: it holds raw
    # set_ on the storage, not .view(dtype): the output is no view (no _base for autograd to
    # rebase in-place ops onto).
    return torch.empty(0, dtype=dtype).set_(torch.from_numpy(data).untyped_storage(), 0, like.shape)


def _fills_new_memory() -> bool:
    # torch.use_deterministic_algorithms(True) fills every new tensor (NaN): it would write the
    # slack too, before the advice. Then a plain allocation, as torch makes it.
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
