"""dsnorm as vLLM's ``dsnorm`` provider of the IR ops ``rms_norm`` and ``fused_add_rms_norm``.

vLLM (0.32) dispatches its norms through ``vllm.ir.ops``: each op has a ``native`` impl (the
definition: fp32 math; the fused form normalises the unrounded fp32 sum and returns the sum rounded
to x's dtype; then ``x̂.to(weight.dtype) * weight``, cast to x's dtype) and providers registered
beside it, tried in the order of ``KernelConfig.ir_op_priority``. Installing dsnorm registers the
provider (entry point ``vllm.general_plugins``, loaded in every vLLM process); choosing it is the
user's one setting::

    LLM(model, kernel_config={"ir_op_priority": {"rms_norm": ["dsnorm"],
                                                 "fused_add_rms_norm": ["dsnorm"]}})

(``--ir-op-priority`` on the command line). Bit for bit the ``native`` definition in eager code:
a weight in x's dtype is dsnorm's ``cast="hf"`` (x̂ rounded before the multiply), an fp32 weight
``cast="deepseek"``. ``supports_args`` declines what that does not cover (no weight, a
``variance_size``, other dtype pairs, other devices), and vLLM then runs ``native``.

The impls call dsnorm's public functions, whose ``torch.ops.dsnorm.*`` ops have fake impls: the CPU
platform compiles the model with Dynamo tracing into the chosen impl, and dsnorm's ops land in the
graph as opaque calls. CUDA: registered where vLLM runs on CUDA and Triton imports; untested until
a GPU runs it.
"""

import logging

import torch
from torch import Tensor

from dsnorm.ops import EPS_MAX, EPS_MIN  # dsnorm's op definitions only: no kernel, no numba

PROVIDER = "dsnorm"
OPS = ("rms_norm", "fused_add_rms_norm")
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Under "vllm.": vLLM configures that logger tree (its handler and level), so the line is seen.
logger = logging.getLogger("vllm.plugins.dsnorm")


def _devices() -> tuple:
    """The device types this process serves: cpu always, cuda where vLLM runs on CUDA and Triton
    (dsnorm's GPU kernels) imports."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        try:
            import triton  # noqa: F401
        except ImportError:
            return ("cpu",)
        return ("cpu", "cuda")
    return ("cpu",)


_served: tuple = ()


def _cast(x: Tensor, weight: Tensor) -> str:
    # native multiplies x̂.to(weight.dtype) by weight: in x's dtype that is x̂ rounded first ("hf");
    # an fp32 weight keeps x̂ in fp32 and rounds the product once ("deepseek"). For fp32 x they agree.
    return "hf" if weight.dtype == x.dtype else "deepseek"


def _serves(x, weight, epsilon, variance_size) -> bool:
    """What dsnorm computes bit for bit as ``native`` does: a 1-D weight of x's width in x's dtype
    or fp32, bf16/fp16/fp32 x on a served device, no ``variance_size``, an eps dsnorm accepts."""
    return (
        weight is not None and variance_size is None
        and x.dtype in _ACTIVATION_DTYPES
        and (weight.dtype == x.dtype or weight.dtype == torch.float32)
        and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0]
        and x.device.type in _served and weight.device == x.device
        and EPS_MIN <= epsilon <= EPS_MAX
    )


def rms_norm_supports(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> bool:
    return _serves(x, weight, epsilon, variance_size)


def fused_add_rms_norm_supports(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                                variance_size: int | None = None) -> bool:
    # In place the residual buffer receives the sum in x's dtype (native's), so it must be x's dtype.
    return (_serves(x, weight, epsilon, variance_size)
            and x_residual.dtype == x.dtype and x_residual.shape == x.shape and x_residual.device == x.device)


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """``native``'s ``rms_norm``: ``(x̂.to(weight.dtype) * weight).to(x.dtype)`` with
    ``x̂ = x * rsqrt(mean(x^2) + epsilon)`` in fp32. x: ``[..., n]`` (strided rows read in place)."""
    import dsnorm

    return dsnorm.rms_norm(x, weight, epsilon, cast=_cast(x, weight))


def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    """In place (vLLM's contract for ``inplace=True`` impls): ``x_residual <- s = x + x_residual``
    (fp32 sum rounded to x's dtype), ``x <-`` the norm of the unrounded ``s``; returns
    ``(x, x_residual)``. vLLM clones both first for the functional overload."""
    import dsnorm

    return dsnorm.fused_add_rms_norm_(x, x_residual, weight, epsilon, cast=_cast(x, weight))


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``dsnorm`` impls of both ops (once
    per process) and changes no priority. Imports neither numba nor dsnorm's kernels."""
    global _served
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        logger.warning("dsnorm: vLLM is not importable (%s); the 'dsnorm' norm provider needs "
                       "pip install 'dsnorm[vllm]'", e)
        return
    try:
        from vllm.ir import ops
    except ImportError as e:
        logger.warning("dsnorm: this vLLM has no vllm.ir (IR ops came with vLLM 0.32); the 'dsnorm' "
                       "norm provider is not registered (%s)", e)
        return
    missing = [name for name in OPS if not hasattr(ops, name)]
    if missing:
        logger.warning("dsnorm: vllm.ir.ops lacks %s; the 'dsnorm' norm provider is not registered",
                       ", ".join(missing))
        return
    if PROVIDER in ops.rms_norm.impls:
        return
    _served = _devices()
    ops.rms_norm.register_impl(PROVIDER, supports_args=rms_norm_supports)(rms_norm)
    ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=fused_add_rms_norm_supports,
                                         inplace=True)(fused_add_rms_norm)
    logger.info("dsnorm: registered provider 'dsnorm' for vllm.ir.ops %s on %s%s (choose it with "
                "ir_op_priority; declined calls run native)", " and ".join(OPS), "/".join(_served),
                " (cuda untested)" if "cuda" in _served else "")
