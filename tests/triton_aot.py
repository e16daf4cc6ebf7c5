"""Ahead-of-time compilation of a launcher's own launch for sm_90, for the compile scripts that
tests/test_triton_compile.py and tests/test_fusions_triton.py run in a fresh interpreter
(imported there only: it imports Triton compiled)."""

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
      torch.uint8: "u8", torch.int64: "i64"}


def compile_launch(kernel, args, meta):
    """Compile ``kernel`` for the arguments a launcher would pass, specialised the way Triton's
    runtime does: ints equal to 1 as constexprs, 16-divisible ints and 16-byte-aligned pointers
    marked divisible, the float (eps) as fp64; a bool argument is a launcher bug."""
    sig, consts, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + TY[a.dtype]
            if a.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            raise AssertionError(name)
        elif isinstance(a, int):
            if a == 1:
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32"
                if a % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            # As Triton's runtime types it: the parameter's annotation (an unquoted "fp64" string;
            # under `from __future__ import annotations` Triton sees "'fp64'" and ignores it), else fp32.
            sig[name] = kernel.params[i].annotation_type or "fp32"
    from dsnorm.triton.launch import OPTION_NAMES

    for name, v in meta.items():
        if name not in OPTION_NAMES:
            sig[name] = "constexpr"
            consts[name] = v
    src = ASTSource(kernel, sig, consts, attrs)
    options = {name: meta[name] for name in OPTION_NAMES if name in meta}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def rows(r, n, dtype, stride=None):
    """An ``[r, n]`` tensor, a slice of ``stride``-wide rows when given (the 512-of-576 layout)."""
    return torch.zeros(r, stride or n, dtype=dtype)[:, :n]
