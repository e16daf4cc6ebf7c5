"""DTensor sharding rules for the ``torch.ops.dsnorm`` ops (tensor, sequence and data parallel),
the core ops and the fusions' (fp8, MLA latent norms, final norm).

Every dsnorm op normalises each row (the last dimension) on its own, so a :class:`DTensor`
sharded on any *other* dimension (batch ``Shard(0)``, sequence ``Shard(1)``, ...) or replicated
runs the local kernel on each shard, with no communication, and its outputs keep the input's
placements. The rule, per mesh dimension, follows ``x``:

* ``x`` (and ``residual``) ``Shard(d)`` / ``_StridedShard(d)`` with ``d`` not the last dimension,
  or ``Replicate()``: outputs ``y``, ``residual_out``, ``dx``, ``dresidual`` get the same
  placement, ``rstd`` (shape ``x.shape[:-1]``) the same placement too (``d`` < its ndim);
  ``dweight`` becomes ``Partial("sum")`` where ``x`` is sharded (each rank has the sum over its own
  rows; DTensor adds them when the gradient is used), ``Replicate()`` where it is replicated.
  A gain narrower than the compute dtype (a bf16 or fp16 weight) gets its gradient already summed
  (``Replicate()``): the ranks' fp32 parts are all-reduced in fp32, then rounded once to the
  gain's dtype, as in one process (DTensor's cast would round each part, then add in bf16).
* ``x`` sharded on its last (normalised) dimension: refused with an error naming the placements
  to use instead. A norm over a sharded hidden dimension needs an all-reduce of the squared sums
  and would not be bitwise equal to the single-device result; dsnorm does not do it.
* ``x`` ``Partial``: reduced to ``Replicate()`` by DTensor first (a pending sum has no norm).
* ``weight`` must be ``Replicate()`` on every mesh dimension: a sharded gain is a shard of the
  normalised dimension. FSDP2's ``fully_shard`` all-gathers it before the forward, so the op
  never sees the shard; otherwise ``weight.redistribute(mesh, [Replicate()] * mesh.ndim)``.
* Other row inputs (``residual`` out of place, ``dy``, ``dresidual_out``) that are placed
  differently from ``x`` are redistributed to ``x``'s placements by DTensor. The in-place
  ``fused_add_rms_norm_`` cannot write through a redistribution, so there ``residual`` must be
  placed exactly like ``x`` (else an error says so).

Shards may be uneven or empty (a batch of 1 on two ranks): rows are independent, so any split of
the rows is valid, and no strategy is dropped for it (``register_sharding`` would drop it and let
DTensor gather silently; that is why the rules are registered with the sharding propagator's
``register_op_strategy``, the same hook ``register_sharding`` uses, with one strategy per call).

Registration. ``torch.distributed.tensor`` costs ~0.5-0.9 s to import, so dsnorm does not import
it. :func:`install` (run by ``import dsnorm`` where ``torch.distributed`` is available) registers
the rules at once if ``torch.distributed.tensor`` is already imported, and otherwise registers
them right after its first import (a one-shot import hook; a DTensor cannot exist before that).
:func:`register` does it explicitly and is idempotent. Neither touches CUDA.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import SequenceParallel as _TorchSequenceParallel

    # Built by the module __getattr__ below on first use: a subclass of torch's style.
    SequenceParallel: type[_TorchSequenceParallel]

__all__ = ["SequenceParallel", "install", "is_registered", "register"]

_DT_MODULE = "torch.distributed.tensor"

# Roles of the op arguments: "row" = [..., n] like x (the anchor, x, decides the placements),
# "rstd" = x.shape[:-1], "weight" = [n] gain, "batch" = [B] (final_norm's lengths), None = not a
# tensor. Outputs: "row", "rstd", "dweight", and "normed": the fp8 ops' y, a row output when
# return_normed (their last argument) is set, else a [0] placeholder (replicated).
_ROW, _RSTD, _WEIGHT, _DWEIGHT, _BATCH, _NORMED = "row", "rstd", "weight", "dweight", "batch", "normed"

# op name -> (argument roles, output roles, index of the anchor x among the arguments, in place)
_RULES = {
    "rms_norm": ((_ROW, _WEIGHT, None, None), (_ROW,), 0, False),
    "rms_norm_fwd": ((_ROW, _WEIGHT, None, None), (_ROW, _RSTD), 0, False),
    "fused_add_rms_norm": (
        (_ROW, _ROW, _WEIGHT, None, None, None, None), (_ROW, _ROW), 0, False,
    ),
    "fused_add_rms_norm_fwd": (
        (_ROW, _ROW, _WEIGHT, None, None, None, None), (_ROW, _ROW, _RSTD), 0, False,
    ),
    "fused_add_rms_norm_": ((_ROW, _ROW, _WEIGHT, None, None, None), (), 0, True),
    "rms_norm_bwd": ((_ROW, _ROW, _WEIGHT, _RSTD), (_ROW, _DWEIGHT), 1, False),
    "fused_add_rms_norm_bwd": (
        (_ROW, _ROW, _ROW, _WEIGHT, _RSTD, _ROW, None), (_ROW, _ROW, _DWEIGHT), 1, False,
    ),
    # The inference fusions (dsnorm.fusions): per row as well. fp8 scales [..., n // block] and the
    # MLA kv output [..., kv_lora_rank] follow the rows.
    "rms_norm_fp8": ((_ROW, _WEIGHT, None, None, None, None), (_ROW, _ROW, _NORMED), 0, False),
    "fused_add_rms_norm_fp8": (
        (_ROW, _ROW, _WEIGHT, None, None, None, None), (_ROW, _ROW, _ROW, _NORMED), 0, False,
    ),
    "mla_latent_norms": ((_ROW, _ROW, _WEIGHT, _WEIGHT, None), (_ROW, _ROW), 0, False),
    # h [B, T, d] -> [B, d]: rows of the batch only (see _BATCH_ONLY).
    "final_norm": ((_ROW, _ROW, _WEIGHT, None, _BATCH), (_ROW, _ROW), 0, False),
}

# Row arguments whose placement is checked for a last-dimension shard (the normalised inputs);
# the others (dy, dresidual_out) are simply redistributed to x's placements.
_CHECKED_ROWS = {
    "rms_norm": (0,), "rms_norm_fwd": (0,), "fused_add_rms_norm": (0, 1),
    "fused_add_rms_norm_fwd": (0, 1), "fused_add_rms_norm_": (0, 1),
    "rms_norm_bwd": (1,), "fused_add_rms_norm_bwd": (1, 2),
    "rms_norm_fp8": (0,), "fused_add_rms_norm_fp8": (0, 1), "mla_latent_norms": (0, 1), "final_norm": (0, 1),
}

# Ops whose anchor may be sharded on dim 0 (the batch) only: final_norm takes each sequence's last
# position, which only one rank of a sequence (Shard(1)) split holds.
_BATCH_ONLY = {"final_norm"}

_registered = False
_lock = threading.RLock()


def is_registered() -> bool:
    """True once the sharding rules are registered with DTensor in this process."""
    return _registered


def _arg_name(op_name: str, index: int) -> str:
    return getattr(torch.ops.dsnorm, op_name).default._schema.arguments[index].name


def _shard_dim(p):
    """The tensor dim of a ``Shard`` / ``_StridedShard`` placement, else None."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(p, (Shard, _StridedShard)):
        return p.dim
    return None


def _last_dim_error(op_name: str, name: str, spec, mesh_dim: int) -> ValueError:
    ndim = spec.ndim
    if ndim > 1:
        rows = " or ".join(f"Shard({d})" for d in range(min(ndim - 1, 2)))
        # One placement per mesh dim: every shard of the last dim becomes Shard(0), a Partial
        # (which the rule reduces anyway) Replicate(), the others stay.
        example = ", ".join(_placement_text(p, ndim) for p in spec.placements)
        instead = (
            f"Shard {name} on a row dimension instead ({rows}: batch or sequence) or use Replicate(), "
            f"e.g. {name}.redistribute(mesh, [{example}]); with tensor parallelism use SequenceParallel() for "
            f"the norm (between RowwiseParallel(output_layouts=Shard(1)) and ColwiseParallel(input_layouts=Shard(1)))"
        )
    else:
        instead = f"Use Replicate(): a 1-D {name} has no row dimension to shard"
    return ValueError(
        f"dsnorm.{op_name}: {name} of shape {tuple(spec.shape)} is sharded on its last dimension "
        f"({spec.placements[mesh_dim]!r} on mesh dim {mesh_dim}), the dimension RMSNorm normalises over; "
        f"dsnorm does not split a row across ranks (that needs an all-reduce of the squared sums). {instead}."
    )


def _placement_text(p, ndim: int) -> str:
    """A placement as code that builds it, for the last-dimension error's example: ``Shard(0)``
    for a shard of the last of ``ndim`` dims, ``Replicate()`` for a ``Partial``."""
    d = _shard_dim(p)
    if d is not None:
        return "Shard(0)" if d % ndim == ndim - 1 else f"Shard({d})"
    return "Replicate()"


def _strategy(op_name: str, op_schema):
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    arg_roles, out_roles, anchor, inplace = _RULES[op_name]
    mesh = op_schema.get_mesh_from_args()
    args = op_schema.args_schema
    specs = [a.strategies[0].output_spec if isinstance(a, OpStrategy) else None for a in args]

    for i in _CHECKED_ROWS[op_name]:
        spec = specs[i]
        if spec is None:
            continue
        for mesh_dim, p in enumerate(spec.placements):
            d = _shard_dim(p)
            if d is not None and d % spec.ndim == spec.ndim - 1:
                raise _last_dim_error(op_name, _arg_name(op_name, i), spec, mesh_dim)

    x_spec = specs[anchor]
    if op_name in _BATCH_ONLY:
        for mesh_dim, p in enumerate(x_spec.placements):
            d = _shard_dim(p)
            if d is not None and d % x_spec.ndim != 0:
                raise ValueError(
                    f"dsnorm.{op_name}: {_arg_name(op_name, anchor)} of shape {tuple(x_spec.shape)} is sharded on "
                    f"dimension {d} ({p!r} on mesh dim {mesh_dim}); it picks each sequence's last position, which "
                    f"one rank of a sequence split holds. Shard it by batch (Shard(0)) or Replicate() it, e.g. "
                    f"h.redistribute(mesh, [Replicate()]) after SequenceParallel, or use last_only=False"
                )
    rows = tuple(Replicate() if p.is_partial() else p for p in x_spec.placements)
    dweight = tuple(Partial("sum") if _shard_dim(p) is not None else Replicate() for p in rows)
    replicate = tuple(Replicate() for _ in rows)

    for i, role in enumerate(arg_roles):
        if role == _WEIGHT and specs[i] is not None and tuple(specs[i].placements) != replicate:
            name = _arg_name(op_name, i)
            raise ValueError(
                f"dsnorm.{op_name}: {name} must be Replicate() on every mesh dim, got placements "
                f"{tuple(specs[i].placements)}: a sharded gain is a shard of the normalised dimension. Under "
                f"FSDP2 (fully_shard) the op sees the all-gathered gain; for a DTensor gain use "
                f"{name}.redistribute(mesh, [Replicate()] * mesh.ndim) or distribute it with Replicate()."
            )
    if inplace and (tuple(specs[1].placements) != tuple(x_spec.placements) or rows != tuple(x_spec.placements)):
        raise ValueError(
            f"dsnorm.{op_name}: in place, x and residual must have the same row placements "
            f"(Shard of a non-last dim, or Replicate()), got x {tuple(x_spec.placements)} and "
            f"residual {tuple(specs[1].placements)}: an input that has to be redistributed cannot be "
            f"written in place; redistribute first or use dsnorm.fused_add_rms_norm"
        )

    normed = rows if op_name.endswith("_fp8") and args[-1] else replicate

    def placed(role):
        # A [B] batch tensor takes x's Shard(0) / Replicate() (the only placements _BATCH_ONLY lets through).
        return {_ROW: rows, _RSTD: rows, _WEIGHT: replicate, _DWEIGHT: dweight, _BATCH: rows, _NORMED: normed}[role]

    input_specs, costs = [], []
    for i, (role, arg) in enumerate(zip(arg_roles, args)):
        if not isinstance(arg, OpStrategy):  # eps, cast, ..., or dresidual_out=None
            continue
        want = DTensorSpec(mesh, placed(role), tensor_meta=specs[i].tensor_meta)
        input_specs.append(want)
        costs.append(generate_redistribute_costs(arg, want))

    outs = tuple(DTensorSpec(mesh, placed(role)) for role in out_roles)
    output_specs = None if not outs else outs[0] if len(outs) == 1 else outs
    return OpStrategy([OpSpec(output_specs=output_specs, input_specs=input_specs, redistribute_cost=costs)])


def register() -> None:
    """Register dsnorm's sharding rules with DTensor (imports ``torch.distributed.tensor``).

    Idempotent and thread-safe; ``import dsnorm`` arranges it automatically (see the module
    docstring), so call it only to register eagerly.
    """
    global _registered
    if _registered:
        return
    if not torch.distributed.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build: no DTensor to register for")
    from functools import partial

    import dsnorm.fusions  # noqa: F401  (defines torch.ops.dsnorm.*, the fusions' ops too)

    # Imported before taking the lock: another thread importing the module at the same time runs
    # register() from the import hook while it holds the module's import lock; holding ours and
    # then waiting for that import would deadlock the two threads.
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    except ImportError as e:  # private module moved in a later torch
        raise RuntimeError(
            f"dsnorm's DTensor rules use torch.distributed.tensor._op_schema, which this torch "
            f"({torch.__version__}) lacks: {e}"
        ) from e
    with _lock:
        if _registered:
            return
        propagator = DTensor._op_dispatcher.sharding_propagator
        for name, (roles, *_rest) in _RULES.items():
            overload = getattr(torch.ops.dsnorm, name).default
            # Hash every non-tensor argument (eps, cast, roundings, residual_dtype) into the
            # sharding cache key: residual_dtype changes the output metadata.
            first_static = next(
                (i for i, a in enumerate(overload._schema.arguments) if not _is_tensor_arg(a)), 100
            )
            propagator.register_op_strategy(
                overload, partial(_strategy, name), RuntimeSchemaInfo(static_argnum=first_static)
            )
        _registered = True
        _remove_hook()


def _is_tensor_arg(arg) -> bool:
    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


# ---------------------------------------------------------------------------------------------
# Lazy registration: after the first import of torch.distributed.tensor.


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _remove_hook()  # the module now exists: registration happens here or never by the hook
        try:
            register()
        except Exception as e:  # never break the user's import of torch.distributed.tensor
            warnings.warn(
                f"dsnorm could not register its DTensor sharding rules ({e!r}); "
                "dsnorm ops will refuse DTensor inputs. Call dsnorm.distributed.register() to see why.",
                RuntimeWarning, stacklevel=2,
            )

    def __getattr__(self, name):  # get_code, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    # Marks every instance, also those of an earlier copy of this module (importlib.reload): the
    # search below skips them all, else two hooks would call each other without end.
    _dsnorm_dtensor_hook = True

    # The finder stays installed until the module is executed (_Loader.exec_module): a find_spec
    # alone (importlib.util.find_spec, a probe for the module) imports nothing, so it must not
    # disarm the registration that the real import still needs.
    def find_spec(self, fullname, path, target=None):
        if fullname != _DT_MODULE:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if getattr(finder, "_dsnorm_dtensor_hook", False) or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_finder = _Finder()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_finder)
    except ValueError:
        pass


def install() -> None:
    """Register the rules now if ``torch.distributed.tensor`` is imported, else right after it is.

    Cheap (no ``torch.distributed.tensor`` import) and idempotent; a no-op where
    ``torch.distributed`` is not available.
    """
    if _registered or not torch.distributed.is_available():
        return
    with _lock:
        # A hook left by an earlier copy of this module (importlib.reload) registers with that copy.
        sys.meta_path[:] = [f for f in sys.meta_path if f is _finder or not getattr(f, "_dsnorm_dtensor_hook", False)]
        imported = _DT_MODULE in sys.modules
        if not imported and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    # Outside the lock, as register() takes it only after its import: the module may be half
    # imported by another thread, whose hook waits for the lock while this import waits for it.
    if imported:
        register()


install()


# ---------------------------------------------------------------------------------------------
# A SequenceParallel style that keeps the residual.


def _make_sequence_parallel():
    from torch.distributed.tensor import DTensor, distribute_module
    from torch.distributed.tensor.parallel import SequenceParallel as _TorchSequenceParallel

    class SequenceParallel(_TorchSequenceParallel):
        """``torch.distributed.tensor.parallel.SequenceParallel`` for norms called with several inputs.

        Torch's style converts only the first input and drops the rest, so ``norm(x, residual)``
        would silently become ``norm(x)``. This one shards every tensor input, positional or keyword
        (``norm(x, residual=r)``), on the sequence dim
        (a plain tensor is taken as this rank's shard, a DTensor is redistributed if placed
        otherwise), keeps non-tensor inputs, replicates the parameters like torch's style, and
        returns DTensors (or their local shards with ``use_local_output=True``). Works for
        ``dsnorm.RMSNorm`` in both forms.
        """

        @staticmethod
        def _prepare_input(sequence_sharding, device_mesh, t):
            if isinstance(t, DTensor):
                if t.placements != sequence_sharding:
                    t = t.redistribute(placements=sequence_sharding)
            elif isinstance(t, torch.Tensor):
                t = DTensor.from_local(t, device_mesh, sequence_sharding, run_check=False)
            return t

        @staticmethod
        def _prepare_outputs(use_local_output, mod, outputs, device_mesh):
            if not use_local_output:
                return outputs
            if isinstance(outputs, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
            return outputs.to_local()

        def _apply(self, module, device_mesh):
            from functools import partial

            module = distribute_module(
                module,
                device_mesh,
                self._replicate_module_fn,
                None,  # inputs below: distribute_module's input hook sees no keyword arguments
                partial(self._prepare_outputs, self.use_local_output),
            )
            sharding, prepare = self.sequence_sharding, self._prepare_input

            def prepare_all(mod, args, kwargs):
                # norm(x, residual=r) as well as norm(x, r): a keyword residual left a plain
                # local shard beside the DTensor x.
                return (tuple(prepare(sharding, device_mesh, t) for t in args),
                        {k: prepare(sharding, device_mesh, v) for k, v in kwargs.items()})

            module.register_forward_pre_hook(prepare_all, with_kwargs=True)
            return module

    SequenceParallel.__module__ = __name__
    return SequenceParallel


if not TYPE_CHECKING:  # type checkers see the SequenceParallel declared above, and no other name

    def __getattr__(name: str) -> Any:
        # Built on first use: it subclasses torch's style, and importing that module costs ~0.5 s.
        if name == "SequenceParallel":
            register()
            cls = _make_sequence_parallel()
            globals()["SequenceParallel"] = cls
            return cls
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
