"""numba's process-wide state as the CPU kernels use it: the threading layer, the kernel cache on
disk, compilation, the thread pool, and what a fork leaves of them.

* Threads: numba's "threadsafe" layers (tbb when installed, else omp) may be entered from several
  Python threads at once (its default workqueue layer may not); a layer the user chose is respected
  (on workqueue, :func:`on_pool` has parallel launches take turns). Every kernel Python calls is
  nogil: concurrent callers' kernels run at once, as torch's ops do, each on its own thread-local
  scratch.
* The cache: every kernel is declared with :func:`kernel`, whose saves to numba's cache take a file
  lock. numba stamps a cached kernel with the file that defines it (its time and size), but a kernel
  compiles the functions it calls from other modules into itself: a cache kept across a change to
  one of those alone (a persistent ``NUMBA_CACHE_DIR`` beside a checkout) ran the old code. So each
  module that defines kernels holds ``DEPENDENCIES_SHA256``, a digest of the ``dsnorm.cpu`` modules
  it imports, directly or not: a change to any of them changes that file too (the digests are
  checked by tests/test_fusions.py).
* Compilation takes one lock, with LLVM's SLP vectoriser on (:func:`compiling`).
* Fork: a child gets fresh copies of the locks another thread may have held mid-launch, mid-compile
  or mid-save; after a GNU OpenMP pool ran, a forked child runs every call serially (dsnorm.forking).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import IO

try:
    import fcntl as _fcntl
except ImportError:  # Windows: numba's own, unlocked cache saves
    _fcntl = None

import numba
import torch
from numba import njit

from dsnorm import forking as _forking

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "threadsafe"

# Below this many elements a call runs on the calling thread: a launch on the pool costs more than
# a second thread saves.
SERIAL_NUMEL = 1 << 14


# ---------------------------------------------------------------------------------------------
# The cache.


def _numba_can_cache() -> bool:
    """Whether numba can cache this package's kernels on disk; warns once when it cannot.

    numba looks for a writable cache directory (``NUMBA_CACHE_DIR``, the package's ``__pycache__``,
    ``~/.cache/numba``) when a ``cache=True`` kernel is decorated, and raises when there is none (a
    read-only image run as another user, a service without a home): that would fail every CPU call.
    Without a cache the kernels are compiled in memory in each process, which costs time, not bits.
    """
    try:
        from numba.core.caching import FunctionCache
    except ImportError:  # a numba that moved it: its decorator decides, as before this probe
        return True

    def probe():  # defined here so that numba locates the cache for this package's directory
        pass

    try:
        FunctionCache(probe)
    except RuntimeError as e:
        warnings.warn(
            f"dsnorm: numba cannot cache compiled kernels on disk ({e}); each process compiles the "
            "kernels it uses again (seconds each on first use). Set NUMBA_CACHE_DIR to a writable directory.",
            RuntimeWarning, stacklevel=2)
        return False
    return True


# Every kernel module, in this directory, takes the same answer.
_CACHE = _numba_can_cache()


def kernel(**options):
    """``njit(nogil=True, cache=_CACHE, **options)``, the kernel's cache saves taken one at a time.

    numba (0.68, ``caching.IndexDataCacheFile.save``) names a new signature's data file from the
    index it has just read, then writes the index and the data file, with no lock between processes:
    two of them saving two signatures of one kernel at once (its f32 and f64 scratch forms, say: two
    pytest-xdist workers, or ranks on different dtypes) can both take ``<kernel>.1.nbc``, and the
    index can be left sending one signature to the other's machine code, which every later process
    would load and run on the wrong types. An exclusive ``flock`` on a file beside the index, held
    for the whole save, puts the saves in order. Loads need none while the processes share one
    source stamp and numba version: numba replaces each file atomically, and a data file the index
    names before it is written reads as a miss (a compile). Where the lock cannot be had (no
    ``fcntl``, a lock file this user cannot open, a file system without locks) the save is numba's
    own; ``flock`` on a network file system may only order the saves of one host.
    """
    def decorate(py_func):
        dispatcher = njit(nogil=True, cache=_CACHE, **options)(py_func)
        cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
        if cache_file is not None and _fcntl is not None:
            cache_file.save = _locked_save(cache_file.save, cache_file._index_path + ".lock")
        return dispatcher
    return decorate


# Lock files open in a save right now. A child forked by another thread meanwhile would hold the
# lock (flock belongs to the open file, which the child shares) for its whole life and stall every
# later save of that kernel: the child closes its copies (never unlocks: that would free the parent's).
_held_cache_locks: set[IO[str]] = set()


def _close_held_cache_locks_in_child() -> None:
    for lock in list(_held_cache_locks):
        lock.close()
    _held_cache_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_cache_locks_in_child)


def _locked_save(unlocked_save, lock_path):
    def locked_save(key, data):
        try:
            lock = open(lock_path, "a")  # "a": created if missing, never truncated
        except OSError:
            return unlocked_save(key, data)
        with lock:  # closing it releases the lock
            _held_cache_locks.add(lock)
            try:
                try:
                    _fcntl.flock(lock, _fcntl.LOCK_EX)
                except OSError:
                    pass
                return unlocked_save(key, data)
            finally:
                _held_cache_locks.discard(lock)
    return locked_save


# ---------------------------------------------------------------------------------------------
# Compilation.

_compile_lock = threading.Lock()
_compiled: set = set()


@contextlib.contextmanager
def compiling():
    """Hold the compile lock with SLP vectorisation on: numba leaves LLVM's SLP vectoriser off by
    default (numba issue 8705); the sum's explicit per-lane accumulators need it to land in vector
    registers. The flag is read when a module is optimised, so it is switched on only around
    dsnorm's own compilations (or cache loads)."""
    with _compile_lock:
        previous = numba.config.SLP_VECTORIZE
        numba.config.SLP_VECTORIZE = 1
        try:
            yield
        finally:
            numba.config.SLP_VECTORIZE = previous


def run(kernel, key, *args) -> None:
    """Call a kernel; its first call per specialisation compiles under :func:`compiling`."""
    if (kernel, key) in _compiled:
        kernel(*args)
        return
    with compiling():
        kernel(*args)
        _compiled.add((kernel, key))


# ---------------------------------------------------------------------------------------------
# The thread pool.

_local = threading.local()
_threading_ready = False


def _start_threading() -> None:
    """Start numba's thread pool without changing torch's thread count.

    The omp pool shares the OpenMP runtime with torch, and starting it resets the runtime's thread
    count to numba's default, which torch.get_num_threads() then reports: a user's
    torch.set_num_threads(1) would silently become 2. Restore torch's setting once the pool runs
    (later numba launches leave it alone).
    """
    global _threading_ready, _pool_lock
    with _compile_lock:
        if not _threading_ready:
            torch_threads = torch.get_num_threads()
            numba.get_num_threads()  # starts the threading layer
            # Only if it changed: torch.set_num_threads also sets the count threads started later
            # inherit, and this thread's count may be older than a set_num_threads elsewhere.
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
            if numba.threading_layer() == "workqueue":
                _pool_lock = threading.Lock()
            _threading_ready = True


# numba's workqueue layer (only where a user chose it: NUMBA_THREADING_LAYER) aborts the process
# when two Python threads launch on its pool at once (numba's parallel regions run without the
# GIL): there, parallel launches take turns on this lock. None on the threadsafe layers.
_pool_lock = None


def _fresh_locks_in_child() -> None:
    # A fork copies a lock held by another thread (a parallel launch, which runs without the GIL,
    # or a first compile) in its held state, and no thread of the child will release it: the
    # child's first parallel call or compile would wait forever (the workqueue layer serves a
    # forked child; the omp layer's child runs serially, dsnorm.forking).
    global _compile_lock, _pool_lock
    _compile_lock = threading.Lock()
    if _pool_lock is not None:
        _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


def on_pool(launch, *args) -> None:
    """``launch(*args)``, a launch on numba's thread pool, taking turns where the layer needs it."""
    if _pool_lock is None:
        launch(*args)
    else:
        with _pool_lock:
            launch(*args)


_fork_warned = False


def threads_for(numel: int) -> int:
    """Threads for a call: torch's setting (torch.set_num_threads governs dsnorm too)."""
    global _fork_warned
    if numel < SERIAL_NUMEL:
        return 1
    if _forking.forked_after_pool:  # see dsnorm.forking
        if torch.get_num_threads() > 1 and not _fork_warned:
            _fork_warned = True
            warnings.warn(
                "dsnorm runs on one thread in this forked process: numba's GNU OpenMP thread pool was "
                "started before the fork and cannot be used after it (install tbb for a fork-safe "
                "pool, or start worker processes with the 'spawn' or 'forkserver' method)",
                RuntimeWarning, stacklevel=2,
            )
        return 1
    if not _threading_ready:
        _start_threading()
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    # numba's count is per calling thread; asking numba for it each call costs more than
    # remembering what this thread last set.
    if getattr(_local, "numba_threads", None) != threads:
        numba.set_num_threads(threads)
        _local.numba_threads = threads
    return threads
