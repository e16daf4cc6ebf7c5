"""CPU kernels (numba) and their launchers: forward (plain / fused / in place) and backward.

Why the kernels look the way they do:

* Bitwise equality with the reference needs the mean's fp32 sum in *torch's* order. ATen's CPU sum
  (``aten/src/ATen/native/cpu/SumKernel.cpp``, ``cascade_sum``) reduces a contiguous row of ``n``
  floats like this, for a vector width of ``L`` lanes (``Vectorized<float>``: 8 lanes on x86, also
  where torch reports AVX512, because the reduction kernels are built for AVX2 only there; 4 lanes
  for doubles):

  1. the row is cut into ``n // L`` whole vectors; those are read as groups of 4 consecutive
     vectors (4 independent accumulators, ``ilp``), ``(n // L) // 4`` groups in all;
  2. groups are added into a level-0 accumulator; after every ``2**p`` groups (``p = max(4,
     ceil_log2(groups) // 4)``, so 16 for any realistic row) level 0 is added into level 1 and
     cleared, and when the group count is also a multiple of ``2**(2p)`` level 1 goes into level 2,
     and likewise into level 3: a 4-level cascade;
  3. leftover groups go into level 0, then levels 1, 2 and 3 are added into level 0 in that order;
  4. the 0–3 whole vectors that did not fill a group are added into accumulator 0, then
     accumulators 1, 2, 3 are added into accumulator 0;
  5. a scalar running sum starts at 0, takes the ``n % L`` tail elements in order, and then the
     ``L`` lanes of accumulator 0 in lane order.

  Rows shorter than one vector take the scalar path, which is steps 1–4 with one lane and no step 5.
  The squares are rounded to fp32 before they are added (the reference materialises ``x.pow(2)``),
  so no multiply-add may be contracted into an FMA (numba never contracts without fastmath).
  Then ``mean = sum / n`` (true division), ``rstd = 1 / sqrt(mean + eps)`` (torch's CPU rsqrt),
  ``xhat = s * rstd`` and only then ``weight * xhat``.
* One pass over memory: each row is widened once into a per-thread fp32 scratch row (it stays in
  L1/L2), which the sum and the output stage then read; inputs are read once, outputs written once.
* Tensors arrive as raw addresses (``data_ptr()``) and element strides: building numpy views costs
  microseconds per tensor, which matters at decode sizes. bf16 is handled as uint16 bits (numba has
  no bfloat16) and fp16 through LLVM's ``half`` (F16C).
* Small inputs run a serial kernel: launching on the thread pool costs more than their work.
* Rows of at most 16 groups (fp32 compute: narrower than 544 elements, kv_norm's 512 included)
  keep the whole cascade in registers (``_sumsq_narrow``): such a row is one chain of dependent
  operations, and the accumulators' round trips through scratch memory made it cost ~58 ns at
  any width up to 128.
* dweight is reduced over fixed row blocks whose size depends only on the shape, then the blocks
  are added in block order: the same bits for any thread count.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import IO

try:
    import fcntl as _fcntl
except ImportError:  # Windows: numba's own, unlocked cache saves
    _fcntl = None

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from dsnorm import forking as _forking
from dsnorm.dispatch import PLAIN_TYPES as _PLAIN_TYPES
from dsnorm.dispatch import dispatch_free
from dsnorm.rows import row_stride, rows_viewable
from dsnorm.spec import CAST_HF as _CASTS_HF
from dsnorm.spec import EPS_MAX as _EPS_MAX
from dsnorm.spec import EPS_MIN as _EPS_MIN
from dsnorm.spec import ROUND_FIRST as _ROUNDINGS_FIRST
from dsnorm.spec import WIDENED_RESIDUALS as _WIDENED_RESIDUALS
from dsnorm.spec import Form

# Threads: numba's "threadsafe" layers (tbb when installed, else omp) may be entered from several
# Python threads at once (its default workqueue layer may not); respect a layer the user chose
# (on workqueue, on_pool has parallel launches take turns). Every kernel Python calls is nogil:
# concurrent callers' kernels run at once, as torch's ops do, each on its own thread-local scratch.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "threadsafe"

F32, BF16, F16, F64 = 0, 1, 2, 3
DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16, torch.float64: F64}

# Below this many elements a call runs on the calling thread: a launch on the pool costs more than
# a second thread saves.
SERIAL_NUMEL = 1 << 14
# Vector lanes torch's CPU sum uses for fp32 (doubles: half as many).
SUM_LANES = 8
# Scratch slots per thread beyond the row itself: 4 cascade levels x 4 accumulators x lanes.
ACC_SLOTS = 4 * 4 * SUM_LANES


def _numba_can_cache() -> bool:
    """Whether numba can cache this file's kernels on disk; warns once when it cannot.

    numba looks for a writable cache directory (``NUMBA_CACHE_DIR``, the package's ``__pycache__``,
    ``~/.cache/numba``) when a ``cache=True`` kernel is decorated, and raises when there is none (a
    read-only image run as another user, a service without a home): that would fail every CPU call.
    Without a cache the kernels are compiled in memory in each process, which costs time, not bits.
    """
    try:
        from numba.core.caching import FunctionCache
    except ImportError:  # a numba that moved it: its decorator decides, as before this probe
        return True

    def probe():  # defined here so that numba locates the cache for this file's directory
        pass

    try:
        FunctionCache(probe)
    except RuntimeError as e:
        warnings.warn(
            f"dsnorm: numba cannot cache compiled kernels on disk ({e}); each process compiles the "
            "kernels it uses again (seconds each on first use). Set NUMBA_CACHE_DIR to a writable directory.",
            RuntimeWarning, stacklevel=2)
        return False
    return True


# cpu_fusions.py, in this directory, takes the same answer.
_CACHE = _numba_can_cache()


def _kernel(**options):
    """``njit(nogil=True, cache=_CACHE, **options)``, the kernel's cache saves taken one at a time.

    numba (0.68, ``caching.IndexDataCacheFile.save``) names a new signature's data file from the
    index it has just read, then writes the index and the data file, with no lock between processes:
    two of them saving two signatures of one kernel at once (its f32 and f64 scratch forms, say: two
    pytest-xdist workers, or ranks on different dtypes) can both take ``<kernel>.1.nbc``, and the
    index can be left sending one signature to the other's machine code, which every later process
    would load and run on the wrong types. An exclusive ``flock`` on a file beside the index, held
    for the whole save, puts the saves in order. Loads need none while the processes share one
    source stamp and numba version: numba replaces each file atomically, and a data file the index
    names before it is written reads as a miss (a compile). Where the lock cannot be had (no
    ``fcntl``, a lock file this user cannot open, a file system without locks) the save is numba's
    own; ``flock`` on a network file system may only order the saves of one host.
    """
    def decorate(py_func):
        dispatcher = njit(nogil=True, cache=_CACHE, **options)(py_func)
        cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
        if cache_file is not None and _fcntl is not None:
            cache_file.save = _locked_save(cache_file.save, cache_file._index_path + ".lock")
        return dispatcher
    return decorate


# Lock files open in a save right now. A child forked by another thread meanwhile would hold the
# lock (flock belongs to the open file, which the child shares) for its whole life and stall every
# later save of that kernel: the child closes its copies (never unlocks: that would free the parent's).
_held_cache_locks: set[IO[str]] = set()


def _close_held_cache_locks_in_child() -> None:
    for lock in list(_held_cache_locks):
        lock.close()
    _held_cache_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_cache_locks_in_child)


def _locked_save(unlocked_save, lock_path):
    def locked_save(key, data):
        try:
            lock = open(lock_path, "a")  # "a": created if missing, never truncated
        except OSError:
            return unlocked_save(key, data)
        with lock:  # closing it releases the lock
            _held_cache_locks.add(lock)
            try:
                try:
                    _fcntl.flock(lock, _fcntl.LOCK_EX)
                except OSError:
                    pass
                return unlocked_save(key, data)
            finally:
                _held_cache_locks.discard(lock)
    return locked_save


# ---------------------------------------------------------------------------------------------
# Intrinsics: addresses to typed pointers, and bit reinterpretation.


def _pointer_intrinsic(elem_type, llvm_type):
    @intrinsic
    def as_pointer(typingctx, addr):
        sig = types.CPointer(elem_type)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], llvm_type.as_pointer())

        return sig, codegen

    return as_pointer


_ptr_f32 = _pointer_intrinsic(types.float32, ir.FloatType())
_ptr_f64 = _pointer_intrinsic(types.float64, ir.DoubleType())
_ptr_u16 = _pointer_intrinsic(types.uint16, ir.IntType(16))


@intrinsic
def _u32_as_f32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, value):
    # fptrunc rounds to nearest even, like torch's conversion.
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always")
def _bf16_to_f32(bits):
    return _u32_as_f32(numba.uint32(bits) << numba.uint32(16))


@njit(inline="always")
def _f32_to_bf16(value):
    # Round to nearest even on the bits; a NaN becomes the quiet NaN 0x7FC0, as in torch.
    u = _f32_as_u32(value)
    rounded = (u + numba.uint32(0x7FFF) + ((u >> numba.uint32(16)) & numba.uint32(1))) >> numba.uint32(16)
    return numba.uint16(0x7FC0) if value != value else numba.uint16(rounded)


@njit(inline="always")
def _round_to(value, code):
    """``value`` rounded to the dtype ``code`` and widened back (a torch ``.to(dtype).float()``)."""
    if code == BF16:
        return _bf16_to_f32(_f32_to_bf16(numba.float32(value)))
    if code == F16:
        return _f16_bits_to_f32(_f32_to_f16_bits(numba.float32(value)))
    if code == F32:
        return numba.float32(value)
    return value


# ---------------------------------------------------------------------------------------------
# Row stages. ``buf`` is the compute-dtype scratch row; each stage branches on the dtype code
# outside its loop so every loop is a plain, vectorisable one.


@njit(inline="always")
def _load_row(addr, offset, code, buf, n, accumulate):
    """buf[:n] (+)= row widened to the compute dtype."""
    if code == BF16:
        p16 = _ptr_u16(addr)
        if accumulate:
            for j in range(n):
                buf[j] += _bf16_to_f32(p16[offset + j])
        else:
            for j in range(n):
                buf[j] = _bf16_to_f32(p16[offset + j])
    elif code == F16:
        p16 = _ptr_u16(addr)
        if accumulate:
            for j in range(n):
                buf[j] += _f16_bits_to_f32(p16[offset + j])
        else:
            for j in range(n):
                buf[j] = _f16_bits_to_f32(p16[offset + j])
    elif code == F32:
        p32 = _ptr_f32(addr)
        if accumulate:
            for j in range(n):
                buf[j] += p32[offset + j]
        else:
            for j in range(n):
                buf[j] = p32[offset + j]
    else:
        p64 = _ptr_f64(addr)
        if accumulate:
            for j in range(n):
                buf[j] += p64[offset + j]
        else:
            for j in range(n):
                buf[j] = p64[offset + j]


@njit(inline="always")
def _store_row(addr, offset, code, buf, n):
    """row = buf[:n] rounded to the dtype ``code``."""
    if code == BF16:
        p16 = _ptr_u16(addr)
        for j in range(n):
            p16[offset + j] = _f32_to_bf16(numba.float32(buf[j]))
    elif code == F16:
        p16 = _ptr_u16(addr)
        for j in range(n):
            p16[offset + j] = _f32_to_f16_bits(numba.float32(buf[j]))
    elif code == F32:
        p32 = _ptr_f32(addr)
        for j in range(n):
            p32[offset + j] = buf[j]
    else:
        p64 = _ptr_f64(addr)
        for j in range(n):
            p64[offset + j] = buf[j]


@njit(inline="always")
def _round_row(buf, n, code):
    """buf[:n] = buf rounded to ``code`` and widened again (round_first)."""
    if code == BF16:
        for j in range(n):
            buf[j] = _bf16_to_f32(_f32_to_bf16(numba.float32(buf[j])))
    elif code == F16:
        for j in range(n):
            buf[j] = _f16_bits_to_f32(_f32_to_f16_bits(numba.float32(buf[j])))
    elif code == F32:
        for j in range(n):
            buf[j] = numba.float32(buf[j])


@njit(inline="always")
def _load_add_store_row(x_addr, x_off, r_addr, r_off, o_addr, o_off, code, buf, n, round_first):
    """The common fused case in one loop, all three rows of one dtype: buf = x + r (rounded to
    ``code`` first for round_first), residual_out = buf rounded to ``code``."""
    if code == BF16 and o_addr == r_addr and o_off == r_off:
        # In place: one pointer for the residual's read and write, so LLVM sees the same address
        # (distance 0) and vectorises; two pointers to the same row fail its runtime overlap check
        # and drop to the scalar loop (~2x slower at [4096, 7168]).
        pr = _ptr_u16(r_addr)
        px = _ptr_u16(x_addr)
        for j in range(n):
            v = _bf16_to_f32(px[x_off + j]) + _bf16_to_f32(pr[r_off + j])
            bits = _f32_to_bf16(v)
            pr[r_off + j] = bits
            buf[j] = _bf16_to_f32(bits) if round_first else v
    elif code == BF16:
        px = _ptr_u16(x_addr)
        pr = _ptr_u16(r_addr)
        po = _ptr_u16(o_addr)
        for j in range(n):
            v = _bf16_to_f32(px[x_off + j]) + _bf16_to_f32(pr[r_off + j])
            bits = _f32_to_bf16(v)
            po[o_off + j] = bits
            buf[j] = _bf16_to_f32(bits) if round_first else v
    elif code == F16:
        hx = _ptr_u16(x_addr)
        hr = _ptr_u16(r_addr)
        ho = _ptr_u16(o_addr)
        for j in range(n):
            v = _f16_bits_to_f32(hx[x_off + j]) + _f16_bits_to_f32(hr[r_off + j])
            bits = _f32_to_f16_bits(v)
            ho[o_off + j] = bits
            buf[j] = _f16_bits_to_f32(bits) if round_first else v
    elif code == F32:
        fx = _ptr_f32(x_addr)
        fr = _ptr_f32(r_addr)
        fo = _ptr_f32(o_addr)
        for j in range(n):
            v = fx[x_off + j] + fr[r_off + j]
            fo[o_off + j] = v
            buf[j] = v
    else:
        dx = _ptr_f64(x_addr)
        dr = _ptr_f64(r_addr)
        do = _ptr_f64(o_addr)
        for j in range(n):
            v = dx[x_off + j] + dr[r_off + j]
            do[o_off + j] = v
            buf[j] = v


@njit(inline="always")
def _store_scaled_row(addr, offset, code, buf, w_addr, rstd, n, cast_hf):
    """row = (w * (buf * rstd)) rounded once to ``code``; Hugging Face order with ``cast_hf``."""
    if code == BF16:
        wb = _ptr_f32(w_addr)
        pb = _ptr_u16(addr)
        if cast_hf:
            for j in range(n):
                pb[offset + j] = _f32_to_bf16(_round_to(wb[j], BF16) * _round_to(buf[j] * rstd, BF16))
        else:
            for j in range(n):
                pb[offset + j] = _f32_to_bf16(wb[j] * (buf[j] * rstd))
    elif code == F16:
        wh = _ptr_f32(w_addr)
        ph = _ptr_u16(addr)
        if cast_hf:
            for j in range(n):
                ph[offset + j] = _f32_to_f16_bits(_round_to(wh[j], F16) * _round_to(buf[j] * rstd, F16))
        else:
            for j in range(n):
                ph[offset + j] = _f32_to_f16_bits(wh[j] * (buf[j] * rstd))
    elif code == F32:
        wf = _ptr_f32(w_addr)
        pf = _ptr_f32(addr)
        for j in range(n):
            pf[offset + j] = wf[j] * (buf[j] * rstd)
    else:
        wd = _ptr_f64(w_addr)
        pd = _ptr_f64(addr)
        for j in range(n):
            pd[offset + j] = wd[j] * (buf[j] * rstd)


# Software prefetch of the next row, interleaved with the store pass (see _forward_rows): every
# _PREFETCH_BYTES of output stored, the matching 64-byte lines of the next row's inputs are
# requested. It pays only for rows that come from DRAM: rows of at least _PREFETCH_MIN_WIDTH
# elements and a thread's share of x of at least _PREFETCH_MIN_BYTES; in place (the sum written
# over the residual and y over x) also from L3, for rows of at least _PREFETCH_IN_PLACE_MIN_WIDTH
# once a thread's share of x passes its L2. Elsewhere it costs time.
_PREFETCH_BYTES = 256
_PREFETCH_MIN_WIDTH = 1024
_PREFETCH_MIN_BYTES = 8 << 20
_PREFETCH_IN_PLACE_MIN_WIDTH = 4096
_PREFETCH_IN_PLACE_MIN_BYTES = 2 << 20


@intrinsic
def _prefetch(typingctx, addr):
    """A read prefetch of the line at ``addr`` into all cache levels (llvm.prefetch: a hint; an
    address past the end of a mapping does not fault)."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        try:
            fn = builder.module.get_global("llvm.prefetch.p0")
        except KeyError:
            fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                             name="llvm.prefetch.p0")
        # (address, 0: read, 3: keep in all levels, 1: data cache)
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@njit(inline="always")
def _code_size(code):
    """Bytes per element of a dtype code."""
    return 4 if code == F32 else (8 if code == F64 else 2)


@njit(inline="always")
def _ceil_log2(x):
    if x <= 2:
        return 1
    bits = 0
    v = x - 1
    while v > 0:
        v >>= 1
        bits += 1
    return bits


def _load_vec(builder, src, index, vec, align):
    """IR: the vector of type ``vec`` at element ``index`` of the element pointer ``src``
    (``align``: the element's alignment, all that is known of a row in the scratch)."""
    return builder.load(builder.bitcast(builder.gep(src, [index]), vec.as_pointer()), align=align)


def _emit_chains(builder, src, count, vec, align):
    """IR of one level-0 step: four accumulator vectors of type ``vec``, from zero, each taking
    ``acc + v * v`` (a rounded square, then a rounded add) for its vector of each of ``count``
    groups of 4 consecutive vectors from the element pointer ``src`` (``align``: the element's
    alignment). Returns the accumulators' allocas, which LLVM keeps in registers."""
    from numba.core import cgutils

    lanes = vec.count
    intp = count.type
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes)) for _ in range(4)]
    with cgutils.for_range(builder, count) as loop:
        base = builder.mul(loop.index, ir.Constant(intp, 4 * lanes))
        for k in range(4):
            v = _load_vec(builder, src, builder.add(base, ir.Constant(intp, lanes * k)), vec, align)
            builder.store(builder.fadd(builder.load(accs[k]), builder.fmul(v, v)), accs[k])
    return accs


@intrinsic
def _chain32(typingctx, buf, offset, count, out):
    """out[t] = sum over g < count of buf[offset + 32 g + t]^2 for t < 32 (buf, out: contiguous
    1-D arrays of one float dtype): thirty-two sequential chains starting from zero, held in four
    explicit 8-lane vectors: the accumulators of one level-0 step.

    Each lane is the scalar chain ``acc += v * v`` (a rounded square, then a rounded add; no FMA:
    no fast-math flag lets LLVM contract them), so the bits are those of 32 scalar accumulators.
    The vectors are written out because LLVM's SLP vectoriser stopped forming them from 32
    scalars (numba 0.68): in a standalone loop the scalar form took 1.5 µs per 7168-element
    row, ~4x its loads, and this one 0.13 µs.
    """
    if not (isinstance(buf, types.Array) and isinstance(out, types.Array) and buf.dtype == out.dtype
            and buf.dtype in (types.float32, types.float64) and buf.ndim == 1 and out.ndim == 1
            and buf.layout == "C" and out.layout == "C"):
        return None
    sig = types.void(buf, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        buf_arg, offset_arg, count_arg, out_arg = args
        elem = context.get_data_type(signature.args[0].dtype)
        vec = ir.VectorType(elem, 8)
        # Only element alignment is known (rows start anywhere in the scratch, the accumulators
        # right after a row of any width): an aligned vector access there would fault.
        align = signature.args[0].dtype.bitwidth // 8
        src = context.make_array(signature.args[0])(context, builder, buf_arg).data
        dst = context.make_array(signature.args[3])(context, builder, out_arg).data
        accs = _emit_chains(builder, builder.gep(src, [offset_arg]), count_arg, vec, align)
        for k in range(4):
            ptr = builder.gep(dst, [ir.Constant(offset_arg.type, 8 * k)])
            builder.store(builder.load(accs[k]), builder.bitcast(ptr, vec.as_pointer()), align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _add32(typingctx, acc, dst, src):
    """acc[dst + t] = acc[dst + t] + acc[src + t] for t < 32 (acc: a contiguous 1-D float array),
    in four 8-lane vectors: the same 32 rounded adds as the scalar loop, which LLVM left scalar."""
    if not (isinstance(acc, types.Array) and acc.dtype in (types.float32, types.float64) and acc.ndim == 1
            and acc.layout == "C"):
        return None
    sig = types.void(acc, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        acc_arg, dst_arg, src_arg = args
        vec = ir.VectorType(context.get_data_type(signature.args[0].dtype), 8)
        align = signature.args[0].dtype.bitwidth // 8
        data = context.make_array(signature.args[0])(context, builder, acc_arg).data
        for k in range(4):
            step = ir.Constant(dst_arg.type, 8 * k)
            to = builder.bitcast(builder.gep(data, [builder.add(dst_arg, step)]), vec.as_pointer())
            frm = builder.bitcast(builder.gep(data, [builder.add(src_arg, step)]), vec.as_pointer())
            total = builder.fadd(builder.load(to, align=align), builder.load(frm, align=align))
            builder.store(total, to, align=align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sumsq_narrow(typingctx, buf, n):
    """The whole cascade of a row of at most 16 groups (at most one level step) and at least one
    vector (fp32: ``8 <= n < 544``; fp64: ``4 <= n < 272``), in registers: 4 x lanes chains over
    the groups, the 0-3 leftover vectors into accumulator 0, then accumulators 1, 2, 3 into 0, then
    a scalar sum of the tail elements' squares and of the lanes. The same rounded operations in the
    same order as ``_sum_step`` / ``_sum_finish``, without their adds to and from zeroed levels
    (adding +0 leaves a sum of squares, never -0, unchanged): the same bits, but for which NaN's
    payload survives a row with NaNs of two payloads (LLVM may swap a float add's operands; torch
    does not promise one either, and its payload was matched more often here than by the array form).

    Why: the array form keeps the accumulators in scratch memory, and a narrow row is all latency
    (store, reload, add, one after another): ~58 ns a row at any width up to 128 on this machine.
    """
    if not (isinstance(buf, types.Array) and buf.dtype in (types.float32, types.float64) and buf.ndim == 1
            and buf.layout == "C" and isinstance(n, types.Integer)):
        return None
    sig = buf.dtype(buf, types.intp)
    lanes = SUM_LANES if buf.dtype == types.float32 else SUM_LANES // 2

    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        buf_arg, n_arg = args
        elem = context.get_data_type(signature.args[0].dtype)
        vec = ir.VectorType(elem, lanes)
        src = context.make_array(signature.args[0])(context, builder, buf_arg).data
        intp = n_arg.type
        nvec = builder.udiv(n_arg, ir.Constant(intp, lanes))
        groups = builder.udiv(nvec, ir.Constant(intp, 4))
        one = ir.Constant(intp, 1)
        align = signature.args[0].dtype.bitwidth // 8  # element alignment only, as in _chain32
        accs = _emit_chains(builder, src, groups, vec, align)
        leftover = builder.mul(groups, ir.Constant(intp, 4))
        with cgutils.for_range_slice(builder, leftover, nvec, one) as (q, _):
            v = _load_vec(builder, src, builder.mul(q, ir.Constant(intp, lanes)), vec, align)
            builder.store(builder.fadd(builder.load(accs[0]), builder.fmul(v, v)), accs[0])
        acc = builder.load(accs[0])
        for k in range(1, 4):
            acc = builder.fadd(acc, builder.load(accs[k]))
        total = cgutils.alloca_once_value(builder, ir.Constant(elem, 0.0))
        with cgutils.for_range_slice(builder, builder.mul(nvec, ir.Constant(intp, lanes)), n_arg, one) as (q, _):
            v = builder.load(builder.gep(src, [q]))
            builder.store(builder.fadd(builder.load(total), builder.fmul(v, v)), total)
        result = builder.load(total)
        for lane in range(lanes):
            result = builder.fadd(result, builder.extract_element(acc, ir.Constant(ir.IntType(32), lane)))
        return result

    return sig, codegen


# Out of line, called by _forward_rows: inlined there, the register sum made the wide rows' threaded
# fused calls fault in a fresh 917 KB output now and then ([64, 7168] bf16: 4-5 of 16 processes
# took 224-page faults in 2-4 of 50 calls, against none before it or with this call; why is not
# understood). The call costs narrow rows a few percent.
@_kernel()
def _narrow_total(buf, n):
    return _sumsq_narrow(buf, n)


@njit(inline="always")
def _chain_lanes(buf, offset, count, lanes, out):
    """The same chains for any lane count (fp64's 4, short rows' 1); the rare cases."""
    for t in range(4 * lanes):
        out[t] = 0.0
    for g in range(count):
        b = offset + 4 * lanes * g
        for t in range(4 * lanes):
            v = buf[b + t]
            out[t] += v * v


@njit(inline="always")
def _level0(buf, group, count, lanes, out):
    """out[0:4*lanes] = fresh level-0 accumulators after ``count`` groups from ``group`` on."""
    if lanes == SUM_LANES:
        _chain32(buf, group * 32, count, out)
    else:
        _chain_lanes(buf, group * 4 * lanes, count, lanes, out)


@njit(inline="always")
def _sum_layout(n, lanes_max):
    """(lanes, whole vectors, groups of 4 vectors, elements per group, level power): the shape of
    ATen's cascade for a row of ``n`` (see the module docstring)."""
    lanes = 1 if n < lanes_max else lanes_max
    nvec = n // lanes
    groups = nvec // 4
    return lanes, nvec, groups, 4 * lanes, max(4, _ceil_log2(groups) // 4)


@njit(inline="always")
def _sum_step(buf, i, lanes, level_power, acc):
    """One level step: groups [i, i + 2**level_power) into level 0 (a fresh chain: level 0 is
    zero at every step's start), then the cascade into levels 1-3. Returns the next group."""
    width = 4 * lanes
    level_step = 1 << level_power
    level_mask = level_step - 1
    _level0(buf, i, level_step, lanes, acc)
    i += level_step
    for level in range(1, 4):
        lo = (level - 1) * width
        hi = level * width
        if width == 32:
            _add32(acc, hi, lo)
        else:
            for t in range(width):
                acc[hi + t] += acc[lo + t]
        for t in range(width):
            acc[lo + t] = 0.0
        if (i & (level_mask << (level * level_power))) != 0:
            break
    return i


@njit(inline="always")
def _sum_finish(buf, n, i, lanes, nvec, groups, acc):
    """The rest of the cascade from group ``i`` on (no whole level step left) and the final sum."""
    width = 4 * lanes
    _level0(buf, i, groups - i, lanes, acc)
    for level in range(1, 4):
        hi = level * width
        if width == 32:
            _add32(acc, 0, hi)
        else:
            for t in range(width):
                acc[t] += acc[hi + t]
    for q in range(groups * 4, nvec):
        base = q * lanes
        for lane in range(lanes):
            v = buf[base + lane]
            acc[lane] += v * v
    for k in range(1, 4):
        for lane in range(lanes):
            acc[lane] += acc[k * lanes + lane]
    if lanes == 1:
        return acc[0]
    acc[4 * width - 1] = 0.0
    total = acc[4 * width - 1]  # a zero of the compute dtype; that slot is free by now
    for q in range(nvec * lanes, n):
        v = buf[q]
        total += v * v
    for lane in range(lanes):
        total += acc[lane]
    return total


@njit(inline="always")
def _load_span(
    lo, hi, buf, row, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    rout_addr, rout_stride, rout_code, round_first, fused_one_dtype,
):
    """Elements [lo, hi) of a row: s = x (+ residual) into buf, residual_out stored."""
    span = buf[lo:hi]
    m = hi - lo
    if res_addr == 0:
        _load_row(x_addr, row * x_stride + lo, x_code, span, m, False)
    elif fused_one_dtype:
        _load_add_store_row(
            x_addr, row * x_stride + lo, res_addr, row * res_stride + lo, rout_addr, row * rout_stride + lo,
            x_code, span, m, round_first,
        )
    else:
        _load_row(x_addr, row * x_stride + lo, x_code, span, m, False)
        _load_row(res_addr, row * res_stride + lo, res_code, span, m, True)
        if round_first:
            _round_row(span, m, x_code)
        if rout_addr != 0:
            _store_row(rout_addr, row * rout_stride + lo, rout_code, span, m)


# A zero and a False typed int64 / bool, not literals: see _forward_rows.
_I0 = np.int64(0)
_NO = np.bool_(False)


# ---------------------------------------------------------------------------------------------
# Calls by address. A parallel kernel calls its per-thread rows kernel through the rows kernel's
# compiled address, handed to it as an argument, instead of by name. Called by name, numba links
# the callee's whole machine-code module into the parallel kernel's and LLVM optimises the linked
# callee again at each of the four stages that build a parallel kernel (its body as a gufunc, the
# gufunc's wrapper, the kernel, its Python wrapper), for code compiled already: on a 2-core Zen 3
# from a cold cache the first prefill fused norm took 27 s, 11 s by address (the six first calls
# of a forward, a backward and the fusions 84 -> 35 s). Called by address, the rows kernel is
# compiled (or loaded from the cache) once, with the serial kernels that call it by name.


def _by_address(*signatures):
    """An intrinsic ``call(address, args)``: calls the numba-compiled function at ``address`` (from
    :func:`compiled_address`, returning None) with the arguments in the tuple ``args``.

    The tuple's types must be one of ``signatures`` (checked when the caller compiles); that the
    address is the compilation for the same one is the launcher's part (:class:`Parallel` checks
    the scratch dtype). An exception the callee raises propagates as from a call by name (inside a
    prange body numba reports it as a ``SystemError`` either way)."""
    allowed = {tuple(signature) for signature in signatures}

    @intrinsic
    def call(typingctx, address, args):
        if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
            return None
        argtypes = tuple(args.types)
        if argtypes not in allowed:
            raise numba.core.errors.TypingError(
                f"a call by address with argument types {argtypes}: none of the signatures compiled "
                f"for it {sorted(map(str, allowed))}")

        def codegen(context, builder, signature, llargs):
            function_type = context.call_conv.get_function_type(types.none, argtypes)
            callee = builder.inttoptr(llargs[0], function_type.as_pointer())
            values = [builder.extract_value(llargs[1], k) for k in range(len(argtypes))]
            status, _ = context.call_conv.call_function(builder, callee, types.none, argtypes, values)
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return context.get_dummy_value()

        return types.none(address, args), codegen

    return call


def scratch_types(ndim: int) -> dict:
    """C-contiguous scratch arrays of ``ndim`` dimensions by compute dtype (x64: float64)."""
    return {x64: types.Array(types.float64 if x64 else types.float32, ndim, "C") for x64 in (False, True)}


_I64 = types.int64
_ROW = scratch_types(1)
_ROWS = scratch_types(2)
# _forward_rows' argument types by compute dtype (x64): every caller passes these.
FORWARD_ROWS_SIGNATURES = {
    x64: (_I64,) * 3 + (_ROW[x64],) + (_I64,) * 13 + (types.float64, types.boolean, types.boolean)
    for x64 in (False, True)
}
_call_forward_rows = _by_address(*FORWARD_ROWS_SIGNATURES.values())


# Not inlined: numba's parfor pass analyses what it inlines into a prange body and dropped the
# rstd store made through a raw pointer there (a wrong result, found by the tests). A call is
# opaque to it, and costs one call per thread.
#
# Its callers pass every argument as a typed value (``_I0``, ``_NO``), never a literal: numba
# compiles a called kernel once per signature and types a literal ``0`` as ``Literal[int](0)``, so a
# serial caller passing ``0`` for ``r0`` and the parallel one passing a computed ``r0`` cost two
# compilations of this function (13-20 s each on a 2-core Zen 3 at 2.4 GHz), one more per caller
# (tests/test_fusions.py checks the calls).
@_kernel()
def _forward_rows(
    r0, r1, n, scratch,
    x_addr, x_stride, x_code,
    res_addr, res_stride, res_code,
    w_addr,
    y_addr, y_stride,
    rout_addr, rout_stride, rout_code,
    rstd_addr, eps_f64, cast_hf, round_first,
):
    buf = scratch[:n]
    acc = scratch[n:]
    lanes_max = SUM_LANES if scratch.itemsize == 4 else SUM_LANES // 2
    # Constants in the compute dtype, through the scratch (numba would widen a float32 op with a
    # Python number to f64): eps rounded to fp32 as torch does for ``var + eps``, and the width.
    acc[0] = eps_f64
    eps = acc[0]
    one = eps / eps
    acc[0] = n
    width = acc[0]  # the mean is a true division by the width, as in torch
    # The one-loop fused stage for the common case; in place it has a bf16 form only (other dtypes
    # take the stage-per-loop path, whose loops each touch one external row and so vectorise).
    fused_one_dtype = (
        res_code == x_code and rout_code == x_code and rout_addr != 0
        and (rout_addr != res_addr or x_code == BF16)
    )
    lanes, nvec, groups, group_len, level_power = _sum_layout(n, lanes_max)
    step_len = group_len << level_power
    x_size = _code_size(x_code)
    res_size = _code_size(res_code)
    w_size = scratch.itemsize  # the weight is in the compute dtype
    in_place_wide = res_addr != 0 and rout_addr == res_addr and n >= _PREFETCH_IN_PLACE_MIN_WIDTH
    min_bytes = _PREFETCH_IN_PLACE_MIN_BYTES if in_place_wide else _PREFETCH_MIN_BYTES
    prefetch = n >= _PREFETCH_MIN_WIDTH and (r1 - r0) * n * x_size >= min_bytes
    chunk = _PREFETCH_BYTES // x_size  # elements stored between two rounds of prefetches
    # Up to one whole level step: with exactly 2**level_power groups the array form's one step moves
    # level 0 into a zeroed level 1 and back (0 + c is c), the register form's single chain.
    narrow = lanes == lanes_max and groups <= (1 << level_power)
    for row in range(r0, r1):
        if not narrow:
            for t in range(group_len, 4 * group_len):
                acc[t] = 0.0
        # A wide row is loaded a level step at a time and each step summed while it is still in
        # L1 (one pass over the row instead of a load pass and a sum pass; the sum's order is
        # unchanged), then the rest; a narrow row in one span. One call site for each inlined stage:
        # numba copies the stage's IR into every site, and with three load sites and two store sites
        # the first [64, 7168] bf16 norm compiled for 77 s on a 2-core Zen 3, 24 s with one each.
        i = 0
        lo = 0
        while True:
            full_step = not narrow and i + (1 << level_power) <= groups
            hi = lo + step_len if full_step else n
            _load_span(lo, hi, buf, row, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
                       rout_addr, rout_stride, rout_code, round_first, fused_one_dtype)
            if not full_step:
                break
            i = _sum_step(buf, i, lanes, level_power, acc)
            lo = hi
        total = _narrow_total(buf, n) if narrow else _sum_finish(buf, n, i, lanes, nvec, groups, acc)
        rstd = one / np.sqrt(total / width + eps)
        if rstd_addr != 0:
            if scratch.itemsize == 4:
                _ptr_f32(rstd_addr)[row] = rstd
            else:
                _ptr_f64(rstd_addr)[row] = rstd
        # While this row is scaled and stored (no DRAM reads of its own), fetch the next one: without
        # it the memory system idles for that pass and the two threads only overlap it by chance.
        # Without prefetching the row is stored in one chunk: one call site, as above.
        prefetching = prefetch and row + 1 < r1
        next_x = x_addr + (row + 1) * x_stride * x_size
        next_res = res_addr + (row + 1) * res_stride * res_size
        lo = 0
        while lo < n:
            hi = min(lo + chunk, n) if prefetching else n
            if prefetching:
                for offset in range(lo * x_size, hi * x_size, 64):
                    _prefetch(next_x + offset)
                if res_addr != 0:
                    for offset in range(lo * res_size, hi * res_size, 64):
                        _prefetch(next_res + offset)
            _store_scaled_row(y_addr, row * y_stride + lo, x_code, buf[lo:hi], w_addr + w_size * lo, rstd,
                              hi - lo, cast_hf)
            lo = hi


@_kernel()
def _forward_serial32(
    rows, n,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    # The scratch row is allocated here: handing numba an array costs more than the allocation.
    _forward_rows(
        _I0, rows, n, np.empty(n + ACC_SLOTS, dtype=np.float32),
        x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
        rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
    )


@_kernel()
def _forward_serial64(
    rows, n,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    _forward_rows(
        _I0, rows, n, np.empty(n + ACC_SLOTS, dtype=np.float64),
        x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
        rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
    )


# Floats of decode scratch on the stack at most: 8.7 KiB, the latent norms' widths (1536, 512). A
# thread's stack may be as small as 32 KiB (threading.stack_size's minimum): 33 KiB of scratch
# (every width to 8192) crashed such a thread at 7168, and 17 KiB (4096) left it little room.
_STACK_SCRATCH = 2048 + ACC_SLOTS


@intrinsic
def _stack_f32(typingctx, count):
    """A pointer to ``count`` uninitialised float32s on the calling function's stack frame."""
    def codegen(context, builder, signature, args):
        return builder.alloca(ir.FloatType(), size=args[0])

    return types.CPointer(types.float32)(types.intp), codegen


@_kernel()
def _decode32(rows, n, code, x_addr, x_stride, res_addr, w_addr, y_addr, rout_addr, eps, cast_hf, round_first):
    # Rows of one dtype, all contiguous but x's: the serial kernel with a third of the arguments
    # (each one costs the call ~25 ns to unbox, about a tenth of a [1, 1536] norm). The scratch
    # row of a narrow call is on the stack: a heap array cost [1, 1536] ~0.14 µs more (the
    # allocation, its reference counts); wider rows keep the heap.
    width = n + ACC_SLOTS
    if width <= _STACK_SCRATCH:
        scratch = numba.carray(_stack_f32(width), width)
    else:
        scratch = np.empty(width, dtype=np.float32)
    _forward_rows(
        _I0, rows, n, scratch,
        x_addr, x_stride, code, res_addr, n, code, w_addr, y_addr, n, rout_addr, n, code, _I0,
        eps, cast_hf, round_first,
    )


@_kernel(parallel=True)
def _forward_parallel(
    rows_kernel, rows, n, scratch,
    x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
    rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
):
    # rows_kernel: _forward_rows' address for this scratch dtype (see _by_address).
    # One contiguous block of rows per thread; a row's bits never depend on the split.
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        _call_forward_rows(rows_kernel, (
            rows * t // nthreads, rows * (t + 1) // nthreads, n, scratch[t],
            x_addr, x_stride, x_code, res_addr, res_stride, res_code, w_addr, y_addr, y_stride,
            rout_addr, rout_stride, rout_code, rstd_addr, eps, cast_hf, round_first,
        ))


@njit(inline="always")
def _dot(a, b, n, zero):
    """sum(a[:n] * b[:n]) with eight interleaved accumulators (a fixed order, so deterministic):
    one running sum would be a chain of n dependent adds, ~8x slower."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
    full = n - n % 8
    for j in range(0, full, 8):
        a0 += a[j] * b[j]
        a1 += a[j + 1] * b[j + 1]
        a2 += a[j + 2] * b[j + 2]
        a3 += a[j + 3] * b[j + 3]
        a4 += a[j + 4] * b[j + 4]
        a5 += a[j + 5] * b[j + 5]
        a6 += a[j + 6] * b[j + 6]
        a7 += a[j + 7] * b[j + 7]
    for j in range(full, n):
        a0 += a[j] * b[j]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@_kernel()  # not inlined, for the same reason as _forward_rows
def _backward_block(
    r0, r1, n, buf, g, dw,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """Rows [r0, r1): dx, dresidual, and this block's dweight partial (``dw``, written)."""
    cd64 = buf.itemsize == 8
    for j in range(n):
        dw[j] = 0.0
    # Compute-dtype constants (a Python number would widen float32 arithmetic to f64).
    zero = dw[0]
    buf[0] = n
    width = buf[0]
    for row in range(r0, r1):
        _load_row(x_addr, row * x_stride, x_code, buf, n, False)
        if res_addr != 0:
            _load_row(res_addr, row * res_stride, res_code, buf, n, True)
            if round_first:
                _round_row(buf, n, x_code)
        # Read through the scratch so rstd keeps the compute dtype in both specialisations.
        if cd64:
            g[0] = _ptr_f64(rstd_addr)[row]
        else:
            g[0] = _ptr_f32(rstd_addr)[row]
        rstd = g[0]
        _load_row(dy_addr, row * dy_stride, x_code, g, n, False)
        if cd64:
            w64 = _ptr_f64(w_addr)
            for j in range(n):
                buf[j] = buf[j] * rstd
                dw[j] += g[j] * buf[j]
                g[j] = g[j] * w64[j]
        else:
            w32 = _ptr_f32(w_addr)
            for j in range(n):
                buf[j] = buf[j] * rstd
                dw[j] += g[j] * buf[j]
                g[j] = g[j] * w32[j]
        mean_dot = _dot(g, buf, n, zero) / width
        for j in range(n):
            g[j] = rstd * (g[j] - buf[j] * mean_dot)
        if dro_addr != 0:
            _load_row(dro_addr, row * dro_stride, dro_code, g, n, True)
        _store_row(dx_addr, row * dx_stride, x_code, g, n)
        if dres_addr != 0:
            _store_row(dres_addr, row * dres_stride, res_code, g, n)


@_kernel()
def _backward_share(
    t, nthreads, rows, n, block_rows, scratch, partials,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """Thread ``t``'s share of the backward's first phase: its consecutive run of the fixed row
    blocks (fixed by ``(rows, block_rows)``; threads only decide who computes which block), with its
    own scratch row."""
    nblocks = partials.shape[0]
    buf = scratch[t, :n]
    g = scratch[t, n:]
    for b in range(nblocks * t // nthreads, nblocks * (t + 1) // nthreads):
        _backward_block(
            b * block_rows, min(rows, (b + 1) * block_rows), n, buf, g, partials[b],
            dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
            w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
            dx_addr, dx_stride, dres_addr, dres_stride, round_first,
        )


@njit(inline="always")
def _column_total(partials, j):
    """Column ``j`` of the partials summed over the blocks in block order."""
    total = partials[0, j]
    for b in range(1, partials.shape[0]):
        total += partials[b, j]
    return total


@_kernel()
def _dweight_columns(partials, dw_addr, j0, j1):
    """dweight[j0:j1] (at ``dw_addr``, the partials' dtype), each column summed over the blocks in
    block order: deterministic dweight. Written in place: the tensor's memory, not a copy."""
    if partials.itemsize == 8:
        out64 = _ptr_f64(dw_addr)
        for j in range(j0, j1):
            out64[j] = _column_total(partials, j)
    else:
        out32 = _ptr_f32(dw_addr)
        for j in range(j0, j1):
            out32[j] = _column_total(partials, j)


# _backward_share's argument types by compute dtype (x64).
BACKWARD_SHARE_SIGNATURES = {
    x64: (_I64,) * 5 + (_ROWS[x64],) * 2 + (_I64,) * 17 + (types.boolean,) for x64 in (False, True)
}
_call_backward_share = _by_address(*BACKWARD_SHARE_SIGNATURES.values())


@_kernel(parallel=True)
def _backward_kernel(
    share_kernel, rows, n, block_rows, scratch, partials, dw_addr,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    # share_kernel: _backward_share's address for this scratch dtype (see _by_address).
    nthreads = scratch.shape[0]
    for t in prange(nthreads):
        # t as int64: prange's index is uint64, the serial kernel's int64 (one signature, see _forward_rows).
        _call_backward_share(share_kernel, (
            np.int64(t), nthreads, rows, n, block_rows, scratch, partials,
            dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
            w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
            dx_addr, dx_stride, dres_addr, dres_stride, round_first,
        ))
    for t in prange(nthreads):
        _dweight_columns(partials, dw_addr, n * t // nthreads, n * (t + 1) // nthreads)


@_kernel()
def _backward_serial(
    rows, n, block_rows, scratch, partials, dw_addr,
    dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
    w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
    dx_addr, dx_stride, dres_addr, dres_stride, round_first,
):
    """``_backward_kernel`` on the calling thread: one share holding every block, then every
    column, so the same bits, with no launch on numba's pool (a forked child must not touch a GNU
    OpenMP pool that ran in its parent; and one thread gains nothing from a launch)."""
    _backward_share(
        _I0, _I0 + 1, rows, n, block_rows, scratch, partials,
        dy_addr, dy_stride, x_addr, x_stride, x_code, res_addr, res_stride, res_code,
        w_addr, rstd_addr, dro_addr, dro_stride, dro_code,
        dx_addr, dx_stride, dres_addr, dres_stride, round_first,
    )
    _dweight_columns(partials, dw_addr, _I0, n)


# ---------------------------------------------------------------------------------------------
# Launchers: allocate scratch, pick serial or parallel, pass addresses. Callers (ops.py) have
# validated shapes and dtypes; every row tensor here is 2-D with unit stride along the row.

_local = threading.local()
_compile_lock = threading.Lock()
_compiled: set = set()


@contextlib.contextmanager
def _compiling():
    """Hold the compile lock with SLP vectorisation on: numba leaves LLVM's SLP vectoriser off by
    default (numba issue 8705); the sum's explicit per-lane accumulators need it to land in vector
    registers. The flag is read when a module is optimised, so it is switched on only around
    dsnorm's own compilations (or cache loads)."""
    with _compile_lock:
        previous = numba.config.SLP_VECTORIZE
        numba.config.SLP_VECTORIZE = 1
        try:
            yield
        finally:
            numba.config.SLP_VECTORIZE = previous


def _run(kernel, key, *args) -> None:
    """Call a kernel; its first call per specialisation compiles under :func:`_compiling`."""
    if (kernel, key) in _compiled:
        kernel(*args)
        return
    with _compiling():
        kernel(*args)
        _compiled.add((kernel, key))


# The serial kernels' compiled entry points, once compiled: calling an entry point directly skips
# the dispatcher's type resolution (~0.2 µs of a ~3 µs decode call). Their argument types never
# vary (Python ints, a float, bools), so each has exactly one specialisation.
_serial_entry: dict = {}


def _serial(x64: bool):
    entry = _serial_entry.get(x64)
    if entry is None:
        kernel = _forward_serial64 if x64 else _forward_serial32

        def entry(*args):
            _run(kernel, None, *args)
            if len(kernel.overloads) == 1:
                _serial_entry[x64] = next(iter(kernel.overloads.values())).entry_point

    return entry


_PAGE = 4096


def thread_rows(nthreads: int, width: int, dtype) -> np.ndarray:
    """``[nthreads, >= width]`` scratch, one row per thread, rows at least a page apart.

    Adjacent rows made two threads share cache lines (and prefetched each other's lines, which
    never cross a page): with one thread writing its accumulators at the end of its row and the
    next writing the start of its own, the lines bounced between the cores. Separating the rows
    took the parallel in-place [4096, 7168] kernel on 2 threads from 4.7-4.8 to 4.4-4.5 ms.
    """
    itemsize = np.dtype(dtype).itemsize
    row_bytes = -(-width * itemsize // _PAGE) * _PAGE + _PAGE
    return np.empty((nthreads, row_bytes // itemsize), dtype=dtype)


def _entry_point(kernel, arg: int, dtype):
    """The compiled entry point of ``kernel``'s specialisation whose argument ``arg`` is an array of
    ``dtype`` (the kernels below are specialised only by their scratch's dtype), or None."""
    for sig, overload in kernel.overloads.items():
        if sig[arg].dtype == numba.from_dtype(dtype):
            return overload.entry_point
    return None


def _first_run(kernel, entries: dict, x64: bool, scratch_arg: int, *args) -> None:
    """A kernel's first call per compute dtype (``_run``: it compiles), its compiled entry point
    then recorded in ``entries[x64]`` for the callers to call directly; for the kernels specialised
    only by their scratch's dtype (argument ``scratch_arg``)."""
    _run(kernel, x64, *args)
    entries[x64] = _entry_point(kernel, scratch_arg, args[scratch_arg].dtype)


def compiled_address(kernel, signature: tuple) -> int:
    """The machine-code address of ``kernel`` compiled for the argument types ``signature``, for a
    call by address (``_by_address``): compiled, or loaded from numba's cache, under
    :func:`_compiling` as in :func:`_run`. Not to be called while ``_compile_lock`` is held."""
    with _compiling():
        kernel.compile(signature)
    overload = kernel.overloads[signature]
    if overload.signature.return_type != types.none:
        # The call is emitted with a None return slot: a wider return value would overrun it.
        raise TypeError(f"{kernel.py_func.__name__} returns {overload.signature.return_type}; a call by address "
                        "takes kernels that return None")
    address = overload.library.get_pointer_to_function(overload.fndesc.llvm_func_name)
    if not address:
        raise RuntimeError(f"numba's engine has no machine code for {kernel.py_func.__name__}{signature}")
    return address


class Parallel:
    """A parallel kernel whose first argument is the address of the rows kernel it calls on each
    thread (``_by_address``), launched on the pool.

    ``kernel``'s specialisations differ only in their scratch's dtype (the kernel's argument
    ``scratch_arg``, the address being argument 0); ``rows_signatures[key]`` is the rows kernel's
    signature for a launch's ``key`` (the compute dtype, x64, or None where there is one), whose
    scratch has the same dtype (checked on the first launch of a key; callers derive the key and
    the scratch from one dtype). Once compiled for a key, launches call the compiled entry point
    with the address directly: the dispatcher's type resolution of ~20 arguments costs ~0.3 µs a
    call, and hashing a dispatcher for ``_run``'s lookup ~70 ns.
    """

    def __init__(self, kernel, rows_kernel, rows_signatures: dict, scratch_arg: int):
        self.kernel = kernel
        self.rows_kernel = rows_kernel
        self.rows_signatures = rows_signatures
        self.scratch_arg = scratch_arg
        # key -> (entry point, rows kernel address) once compiled; hot launchers read it directly.
        self.ready: dict = {}

    def launch(self, key, *args) -> None:
        """``kernel(rows kernel's address, *args)`` on the pool (compiled on first use); ``args``:
        the kernel's arguments after the address."""
        ready = self.ready.get(key)
        if ready is not None:
            on_pool(ready[0], ready[1], *args)
            return
        signature = self.rows_signatures[key]
        scratch = args[self.scratch_arg - 1]
        want = next(t.dtype for t in signature if isinstance(t, types.Array))
        if numba.from_dtype(scratch.dtype) != want:  # the address would be another compilation's
            raise TypeError(f"{self.kernel.py_func.__name__}: a {scratch.dtype} scratch for key {key!r}, whose rows "
                            f"kernel takes {want}")
        address = compiled_address(self.rows_kernel, signature)
        on_pool(_run, self.kernel, key, address, *args)
        entry = _entry_point(self.kernel, self.scratch_arg, scratch.dtype)
        if entry is not None:
            self.ready[key] = (entry, address)


def run_either(nthreads: int, serial, parallel: Parallel, key, *args) -> None:
    """``serial(*args)`` on this thread when ``nthreads == 1`` (through :func:`_run`: compiled on
    first use), else ``parallel.launch(key, *args)`` on the pool."""
    if nthreads == 1:
        _run(serial, key, *args)
    else:
        parallel.launch(key, *args)


_FORWARD_PARALLEL = Parallel(_forward_parallel, _forward_rows, FORWARD_ROWS_SIGNATURES, 3)
_BACKWARD_PARALLEL = Parallel(_backward_kernel, _backward_share, BACKWARD_SHARE_SIGNATURES, 4)
# _FORWARD_PARALLEL's compiled (entry point, address) by x64, read here without the method call
# (~0.2 µs of a ~13 µs [16, 1536] call on the CI machine's CPU).
_forward_ready = _FORWARD_PARALLEL.ready


def _run_parallel(x64: bool, nthreads: int, rows: int, n: int, *args) -> None:
    """``_forward_parallel`` on ``nthreads`` threads with this thread's scratch (args: the
    kernel's arguments after ``scratch``)."""
    scratch = _scratch(nthreads, n + ACC_SLOTS, np.float64 if x64 else np.float32)
    ready = _forward_ready.get(x64)
    if ready is None:
        _FORWARD_PARALLEL.launch(x64, rows, n, scratch, *args)
    else:
        on_pool(ready[0], ready[1], rows, n, scratch, *args)


def _scratch(nthreads: int, width: int, dtype, slot: str = "scratch") -> np.ndarray:
    """This Python thread's ``thread_rows`` scratch, kept between calls of one shape. ``slot``: the
    backward keeps its own (another width), so that a parallel forward and the backward of one
    training step do not evict each other's."""
    key = (nthreads, width, dtype)
    cache = getattr(_local, slot, None)
    if cache is None or cache[0] != key:
        cache = (key, thread_rows(nthreads, width, dtype))
        setattr(_local, slot, cache)
    return cache[1]


_threading_ready = False


def _start_threading() -> None:
    """Start numba's thread pool without changing torch's thread count.

    The omp pool shares the OpenMP runtime with torch, and starting it resets the runtime's thread
    count to numba's default, which torch.get_num_threads() then reports: a user's
    torch.set_num_threads(1) would silently become 2. Restore torch's setting once the pool runs
    (later numba launches leave it alone).
    """
    global _threading_ready, _pool_lock
    with _compile_lock:
        if not _threading_ready:
            torch_threads = torch.get_num_threads()
            numba.get_num_threads()  # starts the threading layer
            # Only if it changed: torch.set_num_threads also sets the count threads started later
            # inherit, and this thread's count may be older than a set_num_threads elsewhere.
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
            if numba.threading_layer() == "workqueue":
                _pool_lock = threading.Lock()
            _threading_ready = True


# numba's workqueue layer (only where a user chose it: NUMBA_THREADING_LAYER) aborts the process
# when two Python threads launch on its pool at once (numba's parallel regions run without the
# GIL): there, parallel launches take turns on this lock. None on the threadsafe layers.
_pool_lock = None


def _fresh_locks_in_child() -> None:
    # A fork copies a lock held by another thread (a parallel launch, which runs without the GIL,
    # or a first compile) in its held state, and no thread of the child will release it: the
    # child's first parallel call or compile would wait forever (the workqueue layer serves a
    # forked child; the omp layer's child runs serially, dsnorm.forking).
    global _compile_lock, _pool_lock
    _compile_lock = threading.Lock()
    if _pool_lock is not None:
        _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


def on_pool(launch, *args) -> None:
    """``launch(*args)``, a launch on numba's thread pool, taking turns where the layer needs it."""
    if _pool_lock is None:
        launch(*args)
    else:
        with _pool_lock:
            launch(*args)


_fork_warned = False


def _threads(numel: int) -> int:
    """Threads for a call: torch's setting (torch.set_num_threads governs dsnorm too)."""
    global _fork_warned
    if numel < SERIAL_NUMEL:
        return 1
    if _forking.forked_after_pool:  # see dsnorm.forking
        if torch.get_num_threads() > 1 and not _fork_warned:
            _fork_warned = True
            warnings.warn(
                "dsnorm runs on one thread in this forked process: numba's GNU OpenMP thread pool was "
                "started before the fork and cannot be used after it (install tbb for a fork-safe "
                "pool, or start worker processes with the 'spawn' or 'forkserver' method)",
                RuntimeWarning, stacklevel=2,
            )
        return 1
    if not _threading_ready:
        _start_threading()
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    # numba's count is per calling thread; numba.get_num_threads() costs ~0.5 µs, so remember
    # what this thread last set instead of asking each call.
    if getattr(_local, "numba_threads", None) != threads:
        numba.set_num_threads(threads)
        _local.numba_threads = threads
    return threads


def _addr(t):
    return 0 if t is None else t.data_ptr()


def _stride(t):
    return 0 if t is None else row_stride(t)


def _code(t, default=F32):
    return default if t is None else DTYPE_CODES[t.dtype]


def forward(x, residual, weight, eps, cast_hf, round_first, y, residual_out, rstd) -> None:
    """y = weight * s * rsqrt(mean(s^2) + eps), s = x (+ residual); residual_out = s; rstd saved.

    x, y: ``[..., n]`` with unit stride along the row and leading dims that collapse to one row
    stride (y may be x); residual, residual_out: the same or None (residual_out may be residual);
    weight: [n] in the compute dtype (fp64 for fp64 x, else fp32); rstd: [rows] contiguous in the
    compute dtype, or None.
    """
    # Every line here runs on every call: at decode sizes this function costs as much as the
    # kernel, so it reads each attribute once and calls no helpers in the common case.
    n = x.shape[-1]
    numel = x.numel()
    if numel == 0:
        return
    x_code = DTYPE_CODES[x.dtype]
    x64 = x_code == F64
    if residual is None:
        r_addr = r_stride = r_code = 0
    else:
        r_addr = residual.data_ptr()
        r_stride = n if residual.is_contiguous() else row_stride(residual)
        r_code = DTYPE_CODES[residual.dtype]
    if residual_out is None:
        o_addr = o_stride = o_code = 0
    else:
        o_addr = residual_out.data_ptr()
        o_stride = n if residual_out.is_contiguous() else row_stride(residual_out)
        o_code = DTYPE_CODES[residual_out.dtype]
    args = (
        x.data_ptr(), n if x.is_contiguous() else row_stride(x), x_code,
        r_addr, r_stride, r_code,
        weight.data_ptr(), y.data_ptr(), n if y.is_contiguous() else row_stride(y),
        o_addr, o_stride, o_code,
        0 if rstd is None else rstd.data_ptr(), float(eps), cast_hf, round_first,
    )
    rows = numel // n
    nthreads = 1 if numel < SERIAL_NUMEL else min(_threads(numel), rows)
    if nthreads == 1:
        (_serial_entry.get(x64) or _serial(x64))(rows, n, *args)
    else:
        _run_parallel(x64, nthreads, rows, n, *args)


def dweight_block_rows(rows: int) -> int:
    """Rows per dweight partial: a function of the row count only (never of the thread count)."""
    return max(16, -(-rows // 256))


# Small backwards run on the calling thread: two threads pay off only once the serial kernel takes
# about twice a pool launch, about when rows * (n + BWD_ROW_COST) reaches BWD_SERIAL_WORK (a row's
# own work, its reductions and loads, costs about as much as 128 more elements).
BWD_ROW_COST = 128
BWD_SERIAL_WORK = 1 << 15
# The serial backward's compiled entry points by compute dtype (as _serial_entry: skips the
# dispatcher's type resolution of its two arrays and 22 scalars).
_backward_entry: dict = {}


def backward(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, dweight) -> None:
    """Gradients of ``forward``: dx (x.dtype), dresidual (residual's dtype; None: not written, the
    caller's dx serves both), dweight ([n] contiguous in the compute dtype, written).

    ds = rstd * (g - xhat * mean(g * xhat)) + dresidual_out, g = dy * weight, xhat = s * rstd;
    dweight = sum over rows of dy * xhat, reduced over fixed row blocks in block order.
    """
    n = x.shape[-1]
    numel = x.numel()
    rows = numel // n
    if rows == 0:
        dweight.zero_()
        return
    x64 = x.dtype == torch.float64
    np_cdtype = np.float64 if x64 else np.float32
    block_rows = dweight_block_rows(rows)
    nblocks = -(-rows // block_rows)
    small = rows * (n + BWD_ROW_COST) < BWD_SERIAL_WORK
    nthreads = 1 if nblocks == 1 or small else min(_threads(max(numel, SERIAL_NUMEL)), nblocks)
    scratch = _scratch(nthreads, 2 * n, np_cdtype, "backward_scratch")
    partials = np.empty((nblocks, n), dtype=np_cdtype)
    args = (
        rows, n, block_rows, scratch, partials, dweight.data_ptr(),
        dy.data_ptr(), row_stride(dy), x.data_ptr(), row_stride(x), DTYPE_CODES[x.dtype],
        _addr(residual), _stride(residual), _code(residual),
        weight.data_ptr(), rstd.data_ptr(),
        _addr(dresidual_out), _stride(dresidual_out), _code(dresidual_out),
        dx.data_ptr(), row_stride(dx), _addr(dresidual), _stride(dresidual), bool(round_first),
    )
    if nthreads > 1:
        _BACKWARD_PARALLEL.launch(x64, *args)
        return
    entry = _backward_entry.get(x64)
    if entry is None:
        _first_run(_backward_serial, _backward_entry, x64, 3, *args)
    else:
        entry(*args)


# ---------------------------------------------------------------------------------------------
# Fresh outputs. A fresh 235 MB output costs more in first-touch page faults (4 KiB each) than the
# kernel costs in arithmetic. This machine's transparent huge pages are in "madvise" mode, so
# advising the fresh buffer before its first touch lets the kernel fault it in 2 MiB pages.

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


# Mid-sized outputs (64 KiB to 32 MiB) come from glibc's heap, not from mmap, once glibc has seen
# a freed block that large, and glibc hands the top of its heap back to the OS whenever more than
# its trim threshold (twice that block) lies free there. A fused call frees two or more such
# outputs together, which can exceed the threshold: then every call returns the pages and faults
# them back in (a call then costs several times as much, depending on the heap's layout). One
# freed block of ``_PRIME_OUTPUTS`` times an output's size raises glibc's thresholds above what a
# call frees, the adjustment glibc makes by itself when a program frees such a block; the block is not written (unless
# torch.use_deterministic_algorithms fills new memory), so it costs an mmap/munmap once per new
# largest size. Outputs stay separate fresh tensors.
_PRIME_MIN_BYTES = 64 << 10
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
    advised plain allocation took 4 KiB pages: ~1000 faults for the two [1, 4096, 7168] bf16
    outputs, a quarter of the call (10.8-11.4 -> 7.6-8.4 ms). An output of 4 MiB or more is
    therefore carved out of an allocation 2 MiB larger than the data, on its first 2 MiB
    boundary. Only the whole huge pages of the data are advised (a partly used one would hold up
    to 2 MiB more than the data). The output's storage is exactly its data, at offset 0 (made
    through numpy, whose array keeps the allocation alive): torch.save, pickle and share_memory_
    copy a tensor's whole storage, and with the allocation's storage they copied the 2 MiB of
    slack too (+50% for a 4 MiB output). Like that of any tensor made from numpy, such a storage
    cannot be resized: ``resize_`` of the tensor to more elements raises (shrinking works), and so does
    ``untyped_storage().resize_(0)`` (to free it early, drop the references or swap ``y.data``).
    """
    nbytes = like.numel() * dtype.itemsize
    if nbytes >= _PRIME_MIN_BYTES and _primed_bytes < min(_PRIME_OUTPUTS * nbytes, _PRIME_MAX_BYTES):
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


# ---------------------------------------------------------------------------------------------
# The decode kernel's entry point: at decode sizes the dispatcher's type resolution costs about
# as much as the kernel, so the lane below calls the compiled entry point directly.

_DECODE_CODES = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}
_F32 = torch.float32
_decode_entry = None


def _compile_decode():
    """Compile (or load) the decode kernel once, then keep (and return) its entry point."""
    global _decode_entry
    x = np.zeros(1, dtype=np.float32)
    w = np.ones(1, dtype=np.float32)
    _run(_decode32, None, 1, 1, F32, x.ctypes.data, 1, 0, w.ctypes.data, x.ctypes.data, 0, 1e-6, False, False)
    _decode_entry = next(iter(_decode32.overloads.values())).entry_point
    return _decode_entry


# ---------------------------------------------------------------------------------------------
# The fast lane: the first thing the ops' CPU implementations, the public functions and the module
# try. It proves, in one attribute pass, what the general path would establish step by step: no
# gradient to record, no compile/functorch/mode/tracing in effect (so the op's implementation is
# what the dispatcher would run), tensor types, dtypes, shapes, devices, an fp32 weight and valid
# options; then it allocates and calls the kernel. It only *recognises*: anything else (a bad
# argument included) returns None and goes the general way, where every error is raised. A decode
# norm is then one attribute pass, one allocation and the kernel.

_is_grad_enabled = torch.is_grad_enabled
_inference_mode_enabled = torch.is_inference_mode_enabled
_STRIDED = torch.strided
_TENSOR, _PARAMETER = _PLAIN_TYPES
PLAIN, FUSED, INPLACE = Form.PLAIN, Form.FUSED, Form.INPLACE


def lane(form, x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    """The result of a call that needs only the kernel, or None (then the general path runs).

    ``form`` (a :class:`dsnorm.spec.Form`) is PLAIN (returns ``y``; residual and its options are
    ignored), FUSED (``(y, residual_out)``) or INPLACE (``(x, residual)``, written; a caller that
    bypasses the dispatcher bumps their version counters, as the dispatcher would). Accepted: plain
    CPU tensors of one dtype (bf16/fp16/fp32; FUSED also takes a residual of another of them, and
    ``residual_dtype=torch.float32``), an fp32 weight, valid options; contiguous rows, or outside
    INPLACE rows of x with one stride between them (the kv_norm slice). Calls below the serial
    size go straight to the decode kernel's entry point and larger ones to its threaded form,
    except FUSED calls with strided x or mixed dtypes, which go to ``forward``. Nothing is taken
    while autograd, torch.compile, torch.jit tracing, functorch, a dispatch/function mode or the
    profiler is in effect, nor for a tensor with the negative bit (a lazily negated view,
    ``x.conj().imag``) or a ZeroTensor (no memory; a slice of one has a made-up nonzero address):
    the dispatcher resolves them, a raw pointer would not; nor, in place, for an inference tensor
    outside inference mode (which torch does not let be written). The rules are
    :mod:`dsnorm.spec`'s (its tables: eps bounds, options, residual dtypes), written out in one
    function, cheapest refusals and the reads every call needs first: at ~40-90 ns per tensor
    attribute and ~60 ns per Python call, they are most of a decode norm.
    """
    tx = type(x)
    tw = type(weight)
    if (tx is not _TENSOR and tx is not _PARAMETER) or (tw is not _TENSOR and tw is not _PARAMETER):
        return None
    grad = _is_grad_enabled()
    if grad and (x.requires_grad or weight.requires_grad):
        return None
    if not dispatch_free():
        return None
    dtype = x.dtype
    code = _DECODE_CODES.get(dtype)
    if code is None or weight.dtype is not _F32 or type(eps) is not float or not _EPS_MIN <= eps <= _EPS_MAX:
        return None
    cast_hf = _CASTS_HF.get(cast) if type(cast) is str else None
    if cast_hf is None or not (x.is_cpu and weight.is_cpu) or x.layout is not _STRIDED:
        return None
    try:  # free unless it raises (a nested x has no shape): then the general path names the problem
        if x.is_neg() or weight.is_neg() or x._is_zerotensor() or weight._is_zerotensor():
            return None
        if not weight.is_contiguous() or weight.ndim != 1:
            return None
        shape = x.shape
        n = weight.numel()
        if not shape or shape[-1] != n:
            return None
        numel = x.numel()
        contiguous = x.is_contiguous()
        if numel == 0 or (not contiguous and (form == INPLACE or not rows_viewable(x))):
            return None
        x_addr = x.data_ptr()
        w_addr = weight.data_ptr()  # raises for a weight of another layout
    except RuntimeError:
        return None
    small = numel < SERIAL_NUMEL
    nbytes = numel * (4 if code == F32 else 2)
    # Outputs below the heap primer's size need none of empty_output's care.
    plain_alloc = nbytes < _PRIME_MIN_BYTES
    if form == PLAIN:
        if plain_alloc:
            y = torch.empty_like(x) if contiguous else torch.empty(shape, dtype=dtype)
        else:
            y = empty_output(x, dtype)
        (_decode_entry or _compile_decode() if small else _lane_parallel)(
            numel // n, n, code, x_addr, n if contiguous else row_stride(x), 0, w_addr, y.data_ptr(), 0,
            eps, cast_hf, False,
        )
        return y
    # The residual: x's shape, contiguous, on the CPU; x's dtype, or in the out-of-place form any
    # of the widened ones (an fp32 stream beside a bf16 x). Every refusal takes the general path,
    # which names the problem.
    tr = type(residual)
    if tr is not _TENSOR and tr is not _PARAMETER:
        return None
    r_dtype = residual.dtype
    if r_dtype is not dtype and (form == INPLACE or r_dtype not in _WIDENED_RESIDUALS):
        return None
    if grad and residual.requires_grad:
        return None
    try:  # a residual of another layout raises in one of these (then the general path names it)
        if residual.shape != shape or not residual.is_contiguous() or not residual.is_cpu:
            return None
        if residual.is_neg() or residual._is_zerotensor():
            return None
        r_addr = residual.data_ptr()
    except RuntimeError:
        return None
    round_first = _ROUNDINGS_FIRST.get(residual_rounding) if type(residual_rounding) is str else None
    if round_first is None or (residual_dtype is not None and (residual_dtype is not _F32 or round_first)):
        return None
    if form == INPLACE and residual_dtype is not None and dtype is not _F32:
        return None  # in place the buffer's dtype decides: the general path names a narrower one
    launch = _decode_entry or _compile_decode() if small else _lane_parallel
    if form == FUSED:
        out_dtype = dtype if residual_dtype is None else residual_dtype
        if plain_alloc:
            if contiguous:  # empty_like: the general path's strides, size-1 dimensions' included
                y, residual_out = torch.empty_like(x), torch.empty_like(x, dtype=out_dtype)
            else:
                y, residual_out = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=out_dtype)
        else:
            y = empty_output(x, dtype)
            residual_out = empty_output(x, out_dtype)
        if contiguous and r_dtype is dtype and out_dtype is dtype:
            launch(numel // n, n, code, x_addr, n, r_addr, w_addr, y.data_ptr(), residual_out.data_ptr(), eps,
                   cast_hf, round_first)
        else:
            # Strided rows of x, or dtypes that differ (an fp32 residual stream): the kernels that
            # take a stride and a dtype per tensor, still ~10 µs short of the general path at decode.
            forward(x, residual, weight, eps, cast_hf, round_first, y, residual_out, None)
        return y, residual_out
    w_end = w_addr + 4 * n  # the weight is read while x and residual are written: apart from both
    if not ((x_addr + nbytes <= r_addr or r_addr + nbytes <= x_addr) and (w_end <= x_addr or x_addr + nbytes <= w_addr)
            and (w_end <= r_addr or r_addr + nbytes <= w_addr)):
        return None
    if not _inference_mode_enabled() and (x.is_inference() or residual.is_inference()):
        return None  # torch writes an inference tensor only in inference mode: the general path says so
    launch(numel // n, n, code, x_addr, n, r_addr, w_addr, x_addr, r_addr, eps, cast_hf, round_first)
    return x, residual


def _lane_parallel(rows, n, code, x_addr, x_stride, res_addr, w_addr, y_addr, rout_addr, eps, cast_hf, round_first):
    """The decode kernel's arguments, run on the thread pool (fp32 compute, contiguous outputs)."""
    nthreads = min(_threads(rows * n), rows)
    if nthreads == 1:
        (_decode_entry or _compile_decode())(
            rows, n, code, x_addr, x_stride, res_addr, w_addr, y_addr, rout_addr, eps, cast_hf, round_first
        )
        return
    _run_parallel(False, nthreads, rows, n, x_addr, x_stride, code, res_addr, n, code, w_addr, y_addr, n,
                  rout_addr, n, code, 0, eps, cast_hf, round_first)
