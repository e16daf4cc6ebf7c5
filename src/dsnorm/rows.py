"""Row geometry: which strided tensors the kernels read in place, and where their bytes lie.

Kernels read rows of unit stride whose leading dims collapse to one row stride (the kv_norm input,
a 512-of-576 slice, is read in place). Anything else is copied once.
"""

from __future__ import annotations

import torch

def rows_viewable(t: torch.Tensor) -> bool:
    """True if ``t`` is ``[..., n]`` with unit stride along n and one stride between rows."""
    if t.is_contiguous():
        return True
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    expected = None
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def readable_rows(t: torch.Tensor) -> torch.Tensor:
    return t if rows_viewable(t) else t.contiguous()


def row_stride(t: torch.Tensor) -> int:
    """Element stride between rows of a ``[..., n]`` tensor whose leading dims collapse to one
    stride (``rows_viewable``): no 2-D view is built, since a view costs ~1 µs at decode."""
    if t.is_contiguous():
        return t.shape[-1]
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1:
            return stride
    return t.shape[-1]



def _rows_overlap(t: torch.Tensor) -> bool:
    """Whether two rows of a rows-viewable tensor share memory (a row stride below the width)."""
    n = t.shape[-1]
    if t.numel() <= n:
        return False
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size != 1:
            return stride < n
    return False


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    # By address, not by storage: two storages can hold the same memory (torch.from_numpy of two
    # views of one array, DLPack, frombuffer), and the kernel writes x while it reads residual.
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = address_range(a)
    b0, b1 = address_range(b)
    return a0 < b1 and b0 < a1 and not _rows_interleave(a, b)


def address_range(t: torch.Tensor) -> tuple:
    """The bytes ``[start, end)`` a strided, non-empty tensor's elements lie in."""
    start = t.data_ptr()
    return start, start + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _rows_interleave(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two rows-viewable tensors whose address ranges overlap still share no element: ``b``'s
    rows lie in the gaps between ``a``'s, at one common row stride in bytes (``buf[:, :n]`` and
    ``buf[:, n:]`` of one ``[rows, 2n]`` buffer), or ``b`` is 1-D and lies in one gap (a weight,
    ``buf[0, 2n:]`` beside ``buf[:, :n]``)."""
    if not (rows_viewable(a) and rows_viewable(b)) or a.dim() < 2:
        return False
    stride = row_stride(a) * a.element_size()
    if stride <= 0 or (b.dim() >= 2 and stride != row_stride(b) * b.element_size()) or b.dim() == 0:
        return False
    width_a, width_b = a.shape[-1] * a.element_size(), b.shape[-1] * b.element_size()
    offset = (b.data_ptr() - a.data_ptr()) % stride  # where b's rows start within a's row period
    return width_a <= offset and offset + width_b <= stride

