"""``RMSNorm``: a drop-in for DeepSeek-V3.2-Exp's ``inference/model.py`` RMSNorm class."""

from __future__ import annotations

import operator
from typing import Any, Optional, SupportsIndex, Union, overload

import torch
from torch import nn

from torch.nn.modules.module import (
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)

from dsnorm import ops
from dsnorm.autograd import _fused_add_rms_norm, _rms_norm, fused_add_rms_norm, rms_norm
from dsnorm.dispatch import _is_compiling, _tracing_state
from dsnorm.ref import EPS
from dsnorm.spec import Form, check_options

_PLAIN, _FUSED = Form.PLAIN, Form.FUSED

_module_call = nn.Module.__call__  # to notice a tool patching it (FX, quantization), never called

# torch.fx.symbolic_trace records these two calls as nodes (as it records F.rms_norm) instead of
# tracing into their checks, which cannot take Proxies; the traced graph then calls them as eager
# code does.
torch.fx.wrap("rms_norm")
torch.fx.wrap("fused_add_rms_norm")


class RMSNorm(nn.Module):
    """``y = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype)``; with a residual, the norm of the
    unrounded fp32 sum ``s = x + residual`` and ``(y, s.to(x.dtype))``.

    Same constructor, parameter (``weight``, float32, ones) and ``forward`` contract as the
    reference class, so ``load_state_dict`` of a reference checkpoint works unchanged.

    Args:
        dim: width ``n`` of the normalised (last) dimension.
        eps: added to the mean square (1e-6 in every DeepSeek-V3.2 norm).
        cast, residual_rounding, residual_dtype: compatibility options, see
            :func:`dsnorm.fused_add_rms_norm`; the defaults are the reference's numerics.
        device: where ``weight`` is created.

    Shapes: ``x`` and ``residual`` ``[..., dim]``; outputs the same shape, ``y`` in ``x.dtype``.
    """

    def __init__(
        self,
        dim: SupportsIndex,
        eps: float = EPS,
        *,
        cast: str = "deepseek",
        residual_rounding: str = "fp32_sum",
        residual_dtype: Optional[torch.dtype] = None,
        device: Optional[Union[torch.device, str, int]] = None,
    ) -> None:
        super().__init__()
        try:  # ints and what behaves as one (numpy integers, 0-dim integer tensors), as the reference
            boolean = isinstance(dim, bool) or (isinstance(dim, torch.Tensor) and dim.dtype == torch.bool)
            width = None if boolean else operator.index(dim)
        except TypeError:
            width = None
        if width is None or width < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        check_options(eps, cast, residual_rounding, residual_dtype)
        self.dim = width
        self.eps = eps
        self.cast = cast
        self.residual_rounding = residual_rounding
        self.residual_dtype = residual_dtype
        self.weight = nn.Parameter(torch.ones(width, dtype=torch.float32, device=device))

    # What forward returns; the implementation's signature is nn.Module's (hooks and tools may
    # pass anything through). The overloads say what a call returns without hooks that replace it.
    @overload
    def __call__(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...
    @overload
    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def __call__(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ before forward starts, and ``self.weight`` (a Module.__getattr__
        # lookup), cost most of a decode norm. When nothing could make
        # nn.Module.__call__ do more than call this class's own forward (no hooks, local or
        # global; no module-level compile; nobody has patched nn.Module.__call__, as FX and
        # quantization tools do while they run; forward and weight not overridden on the instance
        # or in a subclass), the fast lane is that forward for the calls it accepts (it refuses
        # while torch.jit traces); a call it declines goes on to this class's forward past the lane
        # (tried once), still without nn.Module.__call__ (which would only call forward), unless
        # torch.jit traces (nn.Module.__call__ records the module's scope). Everything else takes
        # the usual path.
        if not (
            kwargs or self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks
            or self._backward_hooks or _global_forward_pre_hooks or _global_forward_hooks
            or _global_backward_pre_hooks or _global_backward_hooks
            or self._compiled_call_impl is not None or _is_compiling()
        ):
            # Not read while dynamo traces: it would guard on the lane being unloaded, which the
            # compiled graph's own op call then changes (a recompile on the second call).
            lane = ops.lane
            nargs = len(args)
            if (
                lane is not None and 0 < nargs <= 2 and nn.Module.__call__ is _module_call
                and (type(self).forward is _forward or self._lane_takes(args)) and "forward" not in self.__dict__
                and "weight" not in self.__dict__
            ):
                residual = args[1] if nargs == 2 else None
                weight = self._parameters.get("weight")
                out = lane(
                    _PLAIN if residual is None else _FUSED, args[0], residual, weight, self.eps, self.cast,
                    self.residual_rounding, self.residual_dtype, True,
                )
                if out is not None:
                    return out
                if type(self).forward is _forward and weight is not None and not _tracing_state():
                    if residual is None:
                        return _rms_norm(args[0], weight, self.eps, self.cast)
                    return _fused_add_rms_norm(args[0], residual, weight, self.eps, self.cast,
                                               self.residual_rounding, self.residual_dtype)
        return super().__call__(*args, **kwargs)

    def _lane_takes(self, args: tuple[Any, ...]) -> bool:
        """Whether a subclass whose forward differs from this class's still computes this call as
        this class's forward does (then the fast lane may take it): never, unless it says so."""
        return False

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps, cast=self.cast)
        return fused_add_rms_norm(
            x, residual, self.weight, self.eps, cast=self.cast,
            residual_rounding=self.residual_rounding, residual_dtype=self.residual_dtype,
        )

    def extra_repr(self) -> str:
        extra = f"{self.dim}, eps={self.eps}"
        if self.cast != "deepseek":
            extra += f", cast={self.cast!r}"
        if self.residual_rounding != "fp32_sum":
            extra += f", residual_rounding={self.residual_rounding!r}"
        if self.residual_dtype is not None:
            extra += f", residual_dtype={self.residual_dtype}"
        return extra


_forward = RMSNorm.forward
