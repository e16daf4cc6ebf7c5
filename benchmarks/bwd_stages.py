"""The backward kernel's software pipelining: an experiment that the library does not ship.

``dsnorm.triton.kernels.rms_norm_bwd_kernel`` loops over its program's rows on its single-block path
with ``tl.range(..., num_stages=NUM_STAGES)``, and ``dsnorm.triton.launch`` always passes 1: the loop
is not pipelined. From 2 up, Triton issues the loads of the next ``NUM_STAGES - 1`` rows (with the
kernel's ``PREFETCH``, of the rows after those) early, as asynchronous copies into shared memory
(``cp.async`` on sm_80+), so that rows in flight cost shared memory, not registers. Only when the
loads are issued changes: each row's arithmetic, and so every bit of the gradients, is the
unpipelined kernel's.

This module launches the library's backward with more stages: :func:`backward_params` (the
launcher's parameters with ``NUM_STAGES`` raised as far as :func:`backward_stages` lets it) and
:func:`backward` (that launch, then the dweight sum, as ``launch.backward_2d`` does them).
benchmarks/gpu_configs.py sweeps 1-3 stages with it; docs/performance.md keeps what that measured
and why the library does not pipeline. Checked without a GPU by tests/test_triton_interpret.py
(under Triton's interpreter, which runs the loop unpipelined) and tests/test_triton_compile.py (the
sm_90 PTX has the ``cp.async`` copies, and Triton's shared memory stays within 99 KiB); on a GPU by
tests/test_cuda.py (the library's bits).

Not a package: the scripts next to it import it by name, the tests load it by its path.
"""

from __future__ import annotations

import torch

from dsnorm.triton import kernels, launch

# Shared memory the pipelined rows may take, (stages - 1) x one row of every input the loop loads,
# less a compute-dtype row when the inputs' dtypes differ (Triton then also converts layouts through
# shared memory: 8-16 KiB measured, next to the stages): stages are dropped until they fit. 96 KiB is
# under every sm_80+ GPU's per-block limit (99 KiB on sm_86/89/120); fp32 [*, 7168] fused rows are
# 96 KiB a stage, so they get 2 stages at most.
BWD_STAGES_SMEM = 96 << 10


def backward_stages(block: int, dtypes, stages: int) -> int:
    """The backward's ``NUM_STAGES`` for ``stages`` asked for: fewer if the rows in flight would pass
    ``BWD_STAGES_SMEM``. ``dtypes``: those of the rows the loop loads, x's first (x, dy, then the
    residual and the residual_out gradient when present)."""
    per_column = sum(d.itemsize for d in dtypes)
    budget = BWD_STAGES_SMEM
    if any(d != dtypes[0] for d in dtypes):
        budget -= block * launch._compute_dtype(dtypes[0]).primitive_bitwidth // 8
    return max(1, min(stages, 1 + budget // (block * per_column)))


def backward_params(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, partials, stages: int):
    """``launch.backward_params`` with the row loop pipelined over ``stages`` (as many as
    :func:`backward_stages` allows; the multi-block path is never pipelined). ``meta`` is a copy:
    the launcher's own is left as it is."""
    grid, args, meta = launch.backward_params(dy, x, residual, weight, rstd, dresidual_out, round_first, dx,
                                              dresidual, partials)
    if meta["SINGLE_BLOCK"]:
        loaded = [t.dtype for t in (x, dy, residual, dresidual_out) if t is not None]
        meta = dict(meta, NUM_STAGES=backward_stages(meta["BLOCK_N"], loaded, stages))
    return grid, args, meta


# The compiled kernels of each launch (``launch._Launches``), per grid and parameters.
_launches: dict = {}


def backward(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual, dweight, stages: int) -> None:
    """``launch.backward_2d`` (2-D tensors, at least one row and one column) with the row loop
    pipelined over ``stages`` (:func:`backward_params`): launched the way the library launches
    (``launch._launch``: on CUDA, the compiled kernel called directly after the first launch), then
    dweight summed from the partials as the library sums them."""
    partials = launch.backward_partials(x, fused=residual is not None)
    grid, args, meta = backward_params(dy, x, residual, weight, rstd, dresidual_out, round_first, dx, dresidual,
                                       partials, stages)
    key = (grid, tuple(meta.items()))
    launches = _launches.get(key)
    if launches is None:
        launches = _launches[key] = launch._Launches(grid)
    with launch.on_device(x):
        launch._launch(kernels.rms_norm_bwd_kernel, grid, args, meta, launches)
    if dweight.dtype == partials.dtype:
        torch.sum(partials, dim=0, out=dweight)
    else:
        dweight.copy_(partials.sum(dim=0))
