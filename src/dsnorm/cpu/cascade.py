"""The mean's fp32 sum of squares, in torch's order: bitwise equality with the reference needs it.

ATen's CPU sum (``aten/src/ATen/native/cpu/SumKernel.cpp``, ``cascade_sum``) reduces a contiguous
row of ``n`` floats like this, for a vector width of ``L`` lanes (``Vectorized<float>``: 8 lanes on
x86, also where torch reports AVX512, because the reduction kernels are built for AVX2 only there;
4 lanes for doubles):

1. the row is cut into ``n // L`` whole vectors; those are read as groups of 4 consecutive vectors
   (4 independent accumulators, ``ilp``), ``(n // L) // 4`` groups in all;
2. groups are added into a level-0 accumulator; after every ``2**p`` groups (``p = max(4,
   ceil_log2(groups) // 4)``, so 16 for any realistic row) level 0 is added into level 1 and
   cleared, and when the group count is also a multiple of ``2**(2p)`` level 1 goes into level 2,
   and likewise into level 3: a 4-level cascade;
3. leftover groups go into level 0, then levels 1, 2 and 3 are added into level 0 in that order;
4. the 0–3 whole vectors that did not fill a group are added into accumulator 0, then accumulators
   1, 2, 3 are added into accumulator 0;
5. a scalar running sum starts at 0, takes the ``n % L`` tail elements in order, and then the ``L``
   lanes of accumulator 0 in lane order.

Rows shorter than one vector take the scalar path, which is steps 1–4 with one lane and no step 5.
The squares are rounded to fp32 before they are added (the reference materialises ``x.pow(2)``), so
no multiply-add may be contracted into an FMA (numba never contracts without fastmath).

A wide row is summed a level step at a time (:func:`sum_step`, then :func:`sum_finish`), its
accumulators in the scratch row's tail (``ACC_SLOTS``); a step's values come from the scratch row,
or, for bf16 rows on CPUs with AVX512-BF16, straight from the inputs (:func:`sum_step_bf16`). A
row of at most 16 groups (fp32 compute: narrower than 544 elements, kv_norm's 512 included) keeps
the whole cascade in registers (:func:`sumsq_narrow`). The chains and adds of the accumulators are
written as vector IR (:func:`_chain32`, :func:`_add32`): LLVM's vectorisers leave them scalar.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from dsnorm.cpu.intrinsics import load_bf16_pair, vector_at

# Vector lanes torch's CPU sum uses for fp32 (doubles: half as many).
SUM_LANES = 8
# Scratch slots per thread beyond the row itself: 4 cascade levels x 4 accumulators x lanes.
ACC_SLOTS = 4 * 4 * SUM_LANES


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
    return builder.load(vector_at(builder, src, vec, index), align=align)


def _emit_chains(builder, src, count, vec, align):
    """IR of one level-0 step: four accumulator vectors of type ``vec``, from zero, each taking
    ``acc + v * v`` (a rounded square, then a rounded add) for its vector of each of ``count``
    groups of 4 consecutive vectors from the element pointer ``src`` (``align``: the element's
    alignment). Returns the accumulators' allocas, which LLVM keeps in registers."""
    return _emit_chains_of(builder, lambda index, wide: _load_vec(builder, src, index, wide, align), count, vec)


def _emit_chains_of(builder, load, count, vec, split=False):
    """:func:`_emit_chains` with the vectors from ``load(element index, vector type)``; with
    ``split``, from ``load(element index)``, a group's 32 elements as two 16-lane vectors of its even
    and its odd elements.

    Each lane is its own chain, so accumulators 0 and 1 (and 2 and 3) run as one vector of twice
    the lanes (with ``split``, the even chains and the odd chains), each lane taking the same
    elements in the same order as its scalar chain: the same bits, half the instructions where the
    target has vectors that wide (AVX-512; elsewhere LLVM splits them again). The chains are put
    back in lane order once, after the loop."""
    from numba.core import cgutils

    lanes = vec.count
    intp = count.type
    wide = ir.VectorType(vec.element, 2 * lanes)
    pairs = [cgutils.alloca_once_value(builder, ir.Constant(wide, [0.0] * 2 * lanes)) for _ in range(2)]
    with cgutils.for_range(builder, count) as loop:
        base = builder.mul(loop.index, ir.Constant(intp, 4 * lanes))
        if split:
            halves = load(base)
            assert all(h.type.count == 2 * lanes for h in halves)
        else:
            halves = [load(builder.add(base, ir.Constant(intp, 2 * lanes * k)), wide) for k in range(2)]
        for pair, v in zip(pairs, halves):
            builder.store(builder.fadd(builder.load(pair), builder.fmul(v, v)), pair)
    # The 32 chains in lane order (with ``split``, the even lanes' and the odd lanes' interleaved),
    # as four accumulators.
    first, second = builder.load(pairs[0]), builder.load(pairs[1])
    order = [t for i in range(2 * lanes) for t in (i, 2 * lanes + i)] if split else list(range(4 * lanes))
    chains = builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(ir.IntType(32), 4 * lanes), order))
    accs = []
    for k in range(4):
        part = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [lanes * k + t for t in range(lanes)])
        accs.append(cgutils.alloca_once_value(builder, builder.shuffle_vector(chains, chains, part)))
    return accs


@intrinsic
def _chain32(typingctx, buf, offset, count, out):
    """out[t] = sum over g < count of buf[offset + 32 g + t]^2 for t < 32 (buf, out: contiguous
    1-D arrays of one float dtype): thirty-two sequential chains starting from zero, held in
    explicit vectors (:func:`_emit_chains_of`): the accumulators of one level-0 step.

    Each lane is the scalar chain ``acc += v * v`` (a rounded square, then a rounded add; no FMA:
    no fast-math flag lets LLVM contract them), so the bits are those of 32 scalar accumulators.
    The vectors are written out because LLVM's SLP vectoriser stopped forming them from 32
    scalars (numba 0.68), and the scalar form took several times as long as the row's loads.
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
        _store_accs(builder, accs, dst, vec, align)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _chain32_bf16(typingctx, x_addr, r_addr, offset, count, out):
    """``_chain32`` of the row ``s = x + r`` (``r_addr`` 0: ``s = x``) widened from the bf16 rows
    at those addresses, element ``offset`` on, into ``out`` (a contiguous 1-D float32 array): the
    same bits as ``_chain32`` of ``s`` written to a scratch row first, without writing it.

    fp32 compute only: a float64 ``out`` (the fp64 compilation of a kernel that takes this path
    for fp32 compute alone) raises AssertionError when run."""
    if not (isinstance(out, types.Array) and out.dtype in (types.float32, types.float64) and out.ndim == 1
            and out.layout == "C"):
        return None
    sig = types.void(types.int64, types.int64, types.intp, types.intp, out)

    def codegen(context, builder, signature, args):
        xa, ra, offset_arg, count_arg, out_arg = args
        if _fp32_only(context, builder, signature.args[4], "_chain32_bf16"):
            return context.get_dummy_value()
        vec = ir.VectorType(ir.FloatType(), 8)
        px, pr = _rows_at(builder, offset_arg, xa, ra)
        dst = context.make_array(signature.args[4])(context, builder, out_arg).data
        with builder.if_else(builder.icmp_unsigned("==", ra, ir.Constant(ra.type, 0))) as (plain, fused):
            # Each group's 32 elements as its even and odd halves (load_bf16_pair): the same chains.
            with plain:
                accs = _emit_chains_of(builder, lambda i: load_bf16_pair(builder, px, i), count_arg, vec, True)
                _store_accs(builder, accs, dst, vec, 4)
            with fused:
                def load(i):
                    return [builder.fadd(a, b) for a, b in zip(load_bf16_pair(builder, px, i),
                                                                load_bf16_pair(builder, pr, i))]

                accs = _emit_chains_of(builder, load, count_arg, vec, True)
                _store_accs(builder, accs, dst, vec, 4)
        return context.get_dummy_value()

    return sig, codegen


def _store_accs(builder, accs, dst, vec, align):
    """The four accumulator vectors to ``dst[0:4 * lanes]`` (``align``: the element's alignment)."""
    for k in range(4):
        index = ir.Constant(ir.IntType(64), vec.count * k)
        builder.store(builder.load(accs[k]), vector_at(builder, dst, vec, index), align=align)


def _rows_at(builder, offset, *addresses):
    """i16 pointers to element ``offset`` of the bf16 rows at ``addresses``."""
    return [builder.gep(builder.inttoptr(a, ir.IntType(16).as_pointer()), [offset]) for a in addresses]


def _fp32_only(context, builder, out_type, name):
    """In a kernel's fp64 compilation (``out_type`` a float64 array), code that raises
    AssertionError in place of a bf16 chain, which runs with fp32 compute only; returns whether
    it was emitted."""
    from numba.core import cgutils

    if out_type.dtype == types.float32:
        return False
    with cgutils.if_unlikely(builder, cgutils.true_bit):
        context.call_conv.return_user_exc(builder, AssertionError, (f"{name}: fp32 compute only",))
    return True


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
def sumsq_narrow(typingctx, buf, n):
    """The whole cascade of a row of at most 16 groups (at most one level step) and at least one
    vector (fp32: ``8 <= n < 544``; fp64: ``4 <= n < 272``), in registers: 4 x lanes chains over
    the groups, the 0-3 leftover vectors into accumulator 0, then accumulators 1, 2, 3 into 0, then
    a scalar sum of the tail elements' squares and of the lanes. The same rounded operations in the
    same order as ``sum_step`` / ``sum_finish``, without their adds to and from zeroed levels
    (adding +0 leaves a sum of squares, never -0, unchanged): the same bits, but for which NaN's
    payload survives a row with NaNs of two payloads (LLVM may swap a float add's operands; torch
    does not promise one either, and its payload was matched more often here than by the array form).

    Why: the array form keeps the accumulators in scratch memory, and a narrow row is all latency
    (store, reload, add, one after another), whatever its width.
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
def sum_layout(n, lanes_max):
    """(lanes, whole vectors, groups of 4 vectors, elements per group, level power): the shape of
    ATen's cascade for a row of ``n`` (see the module docstring)."""
    lanes = 1 if n < lanes_max else lanes_max
    nvec = n // lanes
    groups = nvec // 4
    return lanes, nvec, groups, 4 * lanes, max(4, _ceil_log2(groups) // 4)


@njit(inline="always")
def sum_step(buf, i, lanes, level_power, acc):
    """One level step: groups [i, i + 2**level_power) into level 0 (a fresh chain: level 0 is
    zero at every step's start), then the cascade into levels 1-3. Returns the next group."""
    _level0(buf, i, 1 << level_power, lanes, acc)
    return _cascade(i + (1 << level_power), lanes, level_power, acc)


@njit(inline="always")
def sum_step_bf16(x_addr, r_addr, i, level_power, acc):
    """:func:`sum_step` of the row ``x + r`` (``r_addr`` 0: ``x``) read from bf16 rows, 8 lanes."""
    _chain32_bf16(x_addr, r_addr, i * 32, 1 << level_power, acc)
    return _cascade(i + (1 << level_power), SUM_LANES, level_power, acc)


@njit(inline="always")
def _cascade(i, lanes, level_power, acc):
    """After a level step that ends at group ``i``: level 0 into level 1, and on up while ``i`` is
    a multiple of the next level's span. Returns ``i``."""
    width = 4 * lanes
    level_mask = (1 << level_power) - 1
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
def sum_finish(buf, n, i, lanes, nvec, groups, acc):
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
