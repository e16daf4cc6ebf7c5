"""The kernels' building blocks below Python: dtype codes, addresses as typed pointers, bit
reinterpretation and the bf16/fp16 conversions, a cache-line prefetch, stack scratch, and calls by
address, written as LLVM IR where numba has no construct for them.

Tensors reach the kernels as raw addresses (``data_ptr()``) and element strides, read through the
typed pointers made here: building numpy views costs microseconds per tensor, which matters at
decode sizes. numba has no bfloat16: bf16 is handled as uint16 bits (rounded to nearest even on the
bits, as torch does) and fp16 through LLVM's ``half`` (F16C). A dtype travels as its code.
"""

from __future__ import annotations

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


@njit(inline="always")
def bf16_to_f32(bits):
    return u32_as_f32(numba.uint32(bits) << numba.uint32(16))


@njit(inline="always")
def f32_to_bf16(value):
    # Round to nearest even on the bits; a NaN becomes the quiet NaN 0x7FC0, as in torch.
    u = f32_as_u32(value)
    rounded = (u + numba.uint32(0x7FFF) + ((u >> numba.uint32(16)) & numba.uint32(1))) >> numba.uint32(16)
    return numba.uint16(0x7FC0) if value != value else numba.uint16(rounded)


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


@intrinsic
def prefetch_line(typingctx, addr):
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
