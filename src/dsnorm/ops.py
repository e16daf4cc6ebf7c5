"""``torch.library`` custom ops (namespace ``dsnorm``): their impls, fake impls and device dispatch.

Ops (``torch.ops.dsnorm.*``):

* ``rms_norm(x, weight, eps, cast) -> y`` (inference: nothing saved)
* ``fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype)
  -> (y, residual_out)`` (inference)
* ``rms_norm_fwd(x, weight, eps, cast) -> (y, rstd)`` (training: also the per-row rstd)
* ``fused_add_rms_norm_fwd(x, residual, weight, eps, cast, residual_rounding, residual_dtype)
  -> (y, residual_out, rstd)``
* ``fused_add_rms_norm_(x!, residual!, weight, eps, cast, residual_rounding) -> ()`` (in place)
* ``rms_norm_bwd(dy, x, weight, rstd) -> (dx, dweight)``
* ``fused_add_rms_norm_bwd(dy, x, residual, weight, rstd, dresidual_out, residual_rounding)
  -> (dx, dresidual, dweight)``

Every op takes tensors of any leading shape and a unit-stride last dimension (other inputs are
copied once); ``weight`` is already in the compute dtype (fp32, fp64 for fp64 ``x``): the
functional API upcasts other weights. The ops are defined with the low-level
``torch.library.Library`` API: ``@custom_op`` adds several microseconds of Python per call, which
is more than a decode-sized norm costs. The CPU key runs the numba kernels (:mod:`dsnorm.cpu`), the
CUDA key the Triton kernels (:mod:`dsnorm.triton.launch`, imported on first CUDA use). What each op
accepts, and the errors it raises, is :mod:`dsnorm.spec`'s.

The CPU impls of the three inference forms try the CPU fast lane (:func:`dsnorm.cpu.lane.lane`)
first; the ``*_checked`` functions are the same ops without it, registered for CUDA (which never
imports numba) and called by the functional API once its own attempt of the lane declined: the
lane is tried once per call, whichever entry point the call came through.
"""

from __future__ import annotations

import torch

from dsnorm import forking  # noqa: F401 (registers its fork handler when dsnorm is imported)
from dsnorm.dispatch import refuse_forward_ad
from dsnorm.ref import compute_dtype
from dsnorm.rows import readable_rows
from dsnorm.spec import (
    Form,
    check_backward,
    check_inplace,
    check_inplace_options,
    check_inplace_residual,
    check_inplace_weight,
    check_input,
    check_options,
    check_residual,
    check_weight,
    common_case,
    inplace_common_case,
    refuse_inference_write,
    refuse_inplace_grad,
)

# Names the functional API, the fusions and the tools reach through ``ops``, re-exported from the
# modules that define them (the autograd layer calls the train lanes here, where tests replace them).
from dsnorm.rows import address_range, row_stride, rows_viewable  # noqa: F401
from dsnorm.spec import (  # noqa: F401
    _OPTIONS_OK,
    EPS_MAX,
    EPS_MIN,
    INPUT_DTYPES,
    _as_float,
    backward_inputs_match,
    check_dense,
    check_same_sizes,
    residual_dtypes,
    train_lane_fused,
    train_lane_plain,
)

lib = torch.library.Library("dsnorm", "DEF")  # noqa: TOR901 (kept alive for the process)
lib.define("rms_norm(Tensor x, Tensor weight, float eps, str cast) -> Tensor")
lib.define(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, str cast, "
    "str residual_rounding, ScalarType? residual_dtype) -> (Tensor, Tensor)"
)
lib.define("rms_norm_fwd(Tensor x, Tensor weight, float eps, str cast) -> (Tensor, Tensor)")
lib.define(
    "fused_add_rms_norm_fwd(Tensor x, Tensor residual, Tensor weight, float eps, str cast, "
    "str residual_rounding, ScalarType? residual_dtype) -> (Tensor, Tensor, Tensor)"
)
lib.define(
    "fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str cast, "
    "str residual_rounding) -> ()"
)
lib.define("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)")
lib.define(
    "fused_add_rms_norm_bwd(Tensor dy, Tensor x, Tensor residual, Tensor weight, Tensor rstd, "
    "Tensor? dresidual_out, str residual_rounding) -> (Tensor, Tensor, Tensor)"
)


def _rstd_like(x: torch.Tensor) -> torch.Tensor:
    # The leading sizes as separate ints: new_empty parses a torch.Size argument more slowly.
    lead = x.shape[:-1]
    return x.new_empty(*lead, dtype=compute_dtype(x.dtype)) if lead else x.new_empty((), dtype=compute_dtype(x.dtype))


# ---------------------------------------------------------------------------------------------
# Device dispatch: the launchers of one device share one interface.

_launchers: dict = {}


def _launcher(x: torch.Tensor):
    """The launcher module for x's device (looked up by a cheap flag: this runs on every call)."""
    kind = "cpu" if x.is_cpu else x.device.type
    launcher = _launchers.get(kind)
    if launcher is None:
        launcher = _launchers[kind] = _load_launcher(x.device)
    return launcher


def _load_launcher(device: torch.device):
    if device.type == "cpu":
        _load_lane()  # the CPU kernels' modules, and with them the lane
        from dsnorm.cpu import launch

        return launch
    if device.type == "cuda":
        try:
            from dsnorm.triton import launch
        except ImportError as e:  # no slow eager fallback: say what is missing
            raise RuntimeError(
                "dsnorm needs Triton for CUDA tensors (pip install 'dsnorm[gpu]'): " + str(e)
            ) from e
        return launch
    raise NotImplementedError(f"dsnorm has kernels for cpu and cuda tensors, not {device.type}")


def _plain(x, weight, eps, cast, save_rstd):
    if not common_case(x, weight):
        check_input(x)
        check_weight(weight, x)
    check_options(eps, cast)
    return _plain_launch(readable_rows(x), weight, eps, cast, save_rstd)


def _plain_launch(x, weight, eps, cast, save_rstd):
    """The outputs allocated and the kernel launched, for arguments that passed ``_plain``'s checks
    and rows the kernels read in place."""
    launcher = _launcher(x)
    y = launcher.empty_output(x, x.dtype)
    rstd = _rstd_like(x) if save_rstd else None
    launcher.forward(x, None, weight, eps, cast == "hf", False, y, None, rstd)
    return y, rstd


def _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, save_rstd):
    if not common_case(x, weight):
        check_input(x)
        check_weight(weight, x)
    check_residual(residual, x, residual_dtype)
    check_options(eps, cast, residual_rounding, residual_dtype)
    return _fused_launch(readable_rows(x), readable_rows(residual), weight, eps, cast, residual_rounding,
                         residual_dtype, save_rstd)


def _fused_launch(x, residual, weight, eps, cast, residual_rounding, residual_dtype, save_rstd):
    """As ``_plain_launch``, for ``_fused``."""
    launcher = _launcher(x)
    y = launcher.empty_output(x, x.dtype)
    residual_out = launcher.empty_output(x, residual_dtype or x.dtype)
    rstd = _rstd_like(x) if save_rstd else None
    launcher.forward(
        x, residual, weight, eps, cast == "hf", residual_rounding == "round_first", y, residual_out, rstd
    )
    return y, residual_out, rstd

def rms_norm_fwd_unchecked(x, weight, eps, cast):
    """``rms_norm_fwd`` for arguments ``train_lane_plain`` accepted."""
    return _plain_launch(x, weight, eps, cast, True)


def fused_add_rms_norm_fwd_unchecked(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    """``fused_add_rms_norm_fwd`` for arguments ``train_lane_fused`` accepted."""
    return _fused_launch(x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)


def _load_lane():
    """Install the CPU kernels' fast lane (dsnorm.cpu's modules are imported on first CPU use:
    importing dsnorm loads no numba). From then on the functional API and the module try it before
    anything else, and the CPU impls below for calls that come through the dispatcher."""
    global lane
    if lane is None:
        from dsnorm.cpu.lane import lane as cpu_lane

        lane = cpu_lane
    return lane


# dsnorm.cpu.lane.lane once loaded (by the first CPU call, or _load_lane).
lane = None
PLAIN, FUSED, INPLACE = Form.PLAIN, Form.FUSED, Form.INPLACE


def rms_norm(x, weight, eps, cast):
    out = (lane or _load_lane())(PLAIN, x, None, weight, eps, cast, None, None)
    return rms_norm_checked(x, weight, eps, cast) if out is None else out


def rms_norm_checked(x, weight, eps, cast):
    refuse_forward_ad("dsnorm::rms_norm", x, weight)
    return _plain(x, weight, eps, cast, False)[0]


def rms_norm_fwd(x, weight, eps, cast):
    refuse_forward_ad("dsnorm::rms_norm_fwd", x, weight)
    return _plain(x, weight, eps, cast, True)


def fused_add_rms_norm(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    out = (lane or _load_lane())(FUSED, x, residual, weight, eps, cast, residual_rounding, residual_dtype)
    if out is None:
        return fused_add_rms_norm_checked(x, residual, weight, eps, cast, residual_rounding, residual_dtype)
    return out


def fused_add_rms_norm_checked(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    refuse_forward_ad("dsnorm::fused_add_rms_norm", x, residual, weight)
    return _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, False)[:2]


def fused_add_rms_norm_fwd(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    refuse_forward_ad("dsnorm::fused_add_rms_norm_fwd", x, residual, weight)
    return _fused(x, residual, weight, eps, cast, residual_rounding, residual_dtype, True)


def fused_add_rms_norm_inplace(x, residual, weight, eps, cast, residual_rounding):
    # The lane declines an inference tensor outside inference mode, which the checked path refuses.
    if (lane or _load_lane())(INPLACE, x, residual, weight, eps, cast, residual_rounding, None) is None:
        fused_add_rms_norm_inplace_checked(x, residual, weight, eps, cast, residual_rounding)


def fused_add_rms_norm_inplace_checked(x, residual, weight, eps, cast, residual_rounding):
    refuse_forward_ad("dsnorm::fused_add_rms_norm_", x, residual, weight)
    refuse_inference_write(x, residual)
    if not inplace_common_case(x, residual, weight):
        check_input(x)
        check_inplace(x, residual)
        check_weight(weight, x)
        check_inplace_weight(weight, x, residual)
    check_inplace_options(eps, cast, residual_rounding, x, residual)
    _launcher(x).forward(
        x, residual, weight, eps, cast == "hf", residual_rounding == "round_first", x, residual, None
    )


def rms_norm_bwd(dy, x, weight, rstd):
    check_backward(dy, x, weight, rstd)
    return rms_norm_bwd_unchecked(dy, x, weight, rstd)


def fused_add_rms_norm_bwd(dy, x, residual, weight, rstd, dresidual_out, residual_rounding):
    check_backward(dy, x, weight, rstd, residual, dresidual_out)
    check_options(1.0, "deepseek", residual_rounding)
    return fused_add_rms_norm_bwd_unchecked(dy, x, residual, weight, rstd, dresidual_out,
                                            residual_rounding == "round_first")


# The backward ops' bodies without their checks, for the autograd Functions' direct calls: the
# saved tensors passed the forward op's checks (the Functions test them with
# backward_inputs_match, in case they were replaced since), and autograd hands in output gradients of the
# outputs' shape, dtype and device (it casts a gradient of another dtype, refuses another shape
# or device). At training sizes the checks cost more host time than the backward's launch.


def rms_norm_bwd_unchecked(dy, x, weight, rstd):
    rstd = rstd.contiguous()  # the kernels read it as one value per row, unit stride
    x = readable_rows(x)
    launcher = _launcher(x)
    dx = launcher.empty_output(x, x.dtype)
    dweight = torch.empty_like(weight)
    launcher.backward(readable_rows(dy), x, None, weight, rstd, None, False, dx, None, dweight)
    return dx, dweight


def fused_add_rms_norm_bwd_unchecked(dy, x, residual, weight, rstd, dresidual_out, round_first: bool,
                                     write_dresidual: bool = True):
    """``write_dresidual=False`` (a residual in x's dtype only): dresidual comes back None, its
    values being dx's, and the kernels write one ``[rows, n]`` stream less."""
    rstd = rstd.contiguous()  # the kernels read it as one value per row, unit stride
    x = readable_rows(x)
    residual = readable_rows(residual)
    launcher = _launcher(x)
    dx = launcher.empty_output(x, x.dtype)
    dresidual = launcher.empty_output(residual, residual.dtype) if write_dresidual else None
    dweight = torch.empty_like(weight)
    launcher.backward(
        readable_rows(dy), x, residual, weight, rstd,
        None if dresidual_out is None else readable_rows(dresidual_out), round_first,
        dx, dresidual, dweight,
    )
    return dx, dresidual, dweight


# Each op's impl per dispatch key: CPU's inference forms try the lane first, CUDA's never do (the
# lane is CPU-only, and loading it imports numba).
IMPLS = {
    "CPU": {
        "rms_norm": rms_norm,
        "fused_add_rms_norm": fused_add_rms_norm,
        "fused_add_rms_norm_": fused_add_rms_norm_inplace,
    },
    "CUDA": {
        "rms_norm": rms_norm_checked,
        "fused_add_rms_norm": fused_add_rms_norm_checked,
        "fused_add_rms_norm_": fused_add_rms_norm_inplace_checked,
    },
}
for _key, _impls in IMPLS.items():
    _impls.update(rms_norm_fwd=rms_norm_fwd, fused_add_rms_norm_fwd=fused_add_rms_norm_fwd,
                  rms_norm_bwd=rms_norm_bwd, fused_add_rms_norm_bwd=fused_add_rms_norm_bwd)
    for _name, _impl in _impls.items():
        lib.impl(_name, _impl, _key)


def _inplace_autograd(keyset, x, residual, weight, eps, cast, residual_rounding):
    """The in-place op's Autograd kernel: it has no derivative (see refuse_inplace_grad)."""
    refuse_inplace_grad(x, residual, weight)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.dsnorm.fused_add_rms_norm_.default.redispatch(
            keyset & torch._C._after_autograd_keyset, x, residual, weight, eps, cast, residual_rounding
        )


def _inplace_version_bump(keyset, x, residual, weight, eps, cast, residual_rounding):
    """The in-place op's ADInplaceOrView kernel: what torch's in-place ops do there, bump the
    written tensors' version counters, so that a tensor autograd saved before the write fails its
    saved-tensor check at backward instead of giving wrong gradients."""
    with torch._C._AutoDispatchBelowADInplaceOrView():
        torch.ops.dsnorm.fused_add_rms_norm_.default.redispatch(
            keyset & torch._C._after_ADInplaceOrView_keyset, x, residual, weight, eps, cast, residual_rounding
        )
    torch._C._increment_version((x, residual))


lib.impl("fused_add_rms_norm_", _inplace_autograd, "Autograd", with_keyset=True)
lib.impl("fused_add_rms_norm_", _inplace_version_bump, "ADInplaceOrView", with_keyset=True)


# ---------------------------------------------------------------------------------------------
# Fake impls: shapes and dtypes only, after the same checks.


@torch.library.register_fake("dsnorm::rms_norm_fwd", lib=lib)
def _rms_norm_fwd_fake(x, weight, eps, cast):
    check_input(x)
    check_weight(weight, x)
    check_options(eps, cast)
    return torch.empty_like(x, memory_format=torch.contiguous_format), _rstd_like(x)


@torch.library.register_fake("dsnorm::rms_norm", lib=lib)
def _rms_norm_fake(x, weight, eps, cast):
    return _rms_norm_fwd_fake(x, weight, eps, cast)[0]


@torch.library.register_fake("dsnorm::fused_add_rms_norm_fwd", lib=lib)
def _fused_fwd_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    # The real op's order (_fused), so that a call with two faults names the same one in both.
    check_input(x)
    check_weight(weight, x)
    check_residual(residual, x, residual_dtype)
    check_options(eps, cast, residual_rounding, residual_dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(x, dtype=residual_dtype or x.dtype, memory_format=torch.contiguous_format)
    return y, residual_out, _rstd_like(x)


@torch.library.register_fake("dsnorm::fused_add_rms_norm", lib=lib)
def _fused_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype):
    return _fused_fwd_fake(x, residual, weight, eps, cast, residual_rounding, residual_dtype)[:2]


@torch.library.register_fake("dsnorm::fused_add_rms_norm_", lib=lib)
def _fused_inplace_fake(x, residual, weight, eps, cast, residual_rounding):
    check_input(x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    check_inplace_residual(residual, x)
    check_weight(weight, x)
    check_inplace_options(eps, cast, residual_rounding, x, residual)
    if torch._C._is_alias_of(x, residual):
        # Eager code takes two views of one buffer that share no element (buf[:, :n], buf[:, n:]);
        # compiled code with dynamic shapes rebuilds them from one base and loses the residual's
        # offset (torch 2.13; a plain torch.library.custom_op fails the same way), writing
        # norm(x + x). Refused under tracing rather than wrong.
        raise ValueError(
            "x and residual are views of one buffer: under torch.compile (and other tracing) the in-place "
            "form needs them in separate buffers; pass separate tensors, or call it eagerly"
        )
    return None


@torch.library.register_fake("dsnorm::rms_norm_bwd", lib=lib)
def _rms_norm_bwd_fake(dy, x, weight, rstd):
    check_backward(dy, x, weight, rstd)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


@torch.library.register_fake("dsnorm::fused_add_rms_norm_bwd", lib=lib)
def _fused_bwd_fake(dy, x, residual, weight, rstd, dresidual_out, residual_rounding):
    check_backward(dy, x, weight, rstd, residual, dresidual_out)
    check_options(1.0, "deepseek", residual_rounding)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(residual, memory_format=torch.contiguous_format),
        torch.empty_like(weight),
    )
