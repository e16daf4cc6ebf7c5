"""The CPU kernels (numba) and their launchers. Import the module you need; this package imports none
of them (importing dsnorm loads no numba), and its modules import downward only:

* :mod:`~dsnorm.cpu.runtime`: numba's process-wide state: threading layer, kernel cache (the
  ``kernel`` decorator), compile lock, thread pool, fork handling;
* :mod:`~dsnorm.cpu.intrinsics`: dtype codes, typed pointers, bf16/fp16 conversions, prefetch, calls
  by address (LLVM IR);
* :mod:`~dsnorm.cpu.cascade`: the sum of squares in torch's order;
* :mod:`~dsnorm.cpu.stages`: row loads and stores between memory and the scratch row;
* :mod:`~dsnorm.cpu.kernels`: the forward, decode and backward kernels;
* :mod:`~dsnorm.cpu.fusion_kernels`: the fp8, final-norm and MLA kernels;
* :mod:`~dsnorm.cpu.alloc`: fresh outputs (huge pages, heap priming);
* :mod:`~dsnorm.cpu.launch`: the launchers (dsnorm.ops' and dsnorm.fusions' CPU interface);
* :mod:`~dsnorm.cpu.lane`: the fast lanes and the decode entry point.
"""
