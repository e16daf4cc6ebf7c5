"""Whether a call may skip the dispatcher: the probes every fast path reads.

Calling an op's implementation directly is indistinguishable from calling the op only for plain
tensors in memory the kernels can read, with nothing observing or transforming op calls. The
probes are torch's C functions without their Python wrappers: they run on every decode call.
"""

from __future__ import annotations

import sys

import torch

# Tensor types whose data the kernels may be handed directly (no subclass with its own dispatch).
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t) -> bool:
    """True for a DTensor, without importing torch.distributed.tensor (~0.5 s): no DTensor exists
    before its import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)



_transforms_active = torch._C._are_functorch_transforms_active
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_memory(t: torch.Tensor) -> bool:
    """``t`` is memory the kernels may read directly: a plain tensor (no subclass with a dispatch of
    its own) on the CPU or a CUDA device. Meta tensors (and other devices) take the op: its fake
    implementation shapes them. So do a lazily negated view (x.conj().imag), a ZeroTensor (no
    memory) and a functorch wrapper left over from a finished transform (torch.func.vjp's saved
    inputs, when its vjp function is called afterwards: no storage): the dispatcher resolves them,
    the kernels read raw memory."""
    return (type(t) in PLAIN_TYPES and (t.is_cpu or t.is_cuda)
            and not (t.is_neg() or t._is_zerotensor() or _is_wrapped(t)))


_is_compiling = torch.compiler.is_compiling
_functorch_level = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_tracing_state = torch._C._get_tracing_state
_profiler_enabled = torch._C._autograd._profiler_enabled
_forward_ad = torch.autograd.forward_ad  # its _current_level is -1 unless a dual level is open


def dispatch_free() -> bool:
    """True when nothing observes or transforms op calls: no torch.compile/export tracing (checked
    first: nothing after it needs tracing), functorch transform, torch dispatch or function mode,
    torch.jit trace (which records ops, not what an implementation does) or torch.profiler (which
    records ops at the dispatcher) and no forward-mode AD level (a dual input's tangent would be
    dropped). Then calling an op's implementation directly is indistinguishable from calling the
    op. The probes are torch's C functions without their Python wrappers: this runs on every
    decode call."""
    return not (
        _is_compiling() or _functorch_level() is not None or _dispatch_modes() or _function_modes()
        or _tracing_state() or _profiler_enabled() or _forward_ad._current_level >= 0
    )


def refuse_forward_ad(what: str, *tensors) -> None:
    """Forward-mode AD (``torch.autograd.forward_ad``) has no formula in dsnorm: an input carrying a
    tangent is refused by name (the ops would drop it silently). Free when no dual level is open."""
    if _forward_ad._current_level < 0:
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{what} has no forward-mode AD (jvp) formula: an input is a dual tensor "
                "(torch.autograd.forward_ad.make_dual); use reverse mode (backward, torch.func.vjp) instead"
            )

