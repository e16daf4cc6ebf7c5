"""Whether other work shared the CPUs while something was timed (used by ``dsnorm bench``).

When another process holds a core, every call that starts a parallel region can wait a scheduler
slice for its second thread, all through a row: the median is then as slow as the fastest call, so
the spread of the calls cannot show it. The operating system can. Over a window (two
:class:`CpuSample` readings) :func:`judge` computes

* ``others_cpus``: how many CPUs of this process's affinity set were, on average, busy with work
  other than this process: their busy time (``/proc/stat``: elapsed minus idle and iowait, so
  time stolen by a hypervisor counts as busy) less this process's CPU time, over the window, as a
  lower bound (the counters tick in 1/USER_HZ s: one tick per line read at each end is taken
  off); ``others_share`` is the same as a share of those CPUs;
* ``pressure_share``: the share of the window in which some task on the machine waited for a CPU
  (``/proc/pressure/cpu``, "some" total, in microseconds).

A window is contended when both are over their limits: others ran, and someone waited for them.
Others' CPU time alone also counts work on a core this process left idle (a single-threaded row
beside one busy process is timed fairly); pressure alone also counts the microseconds a woken
thread of this process's own pools waits to be scheduled, on an idle machine too.

Other work is judged in CPUs, not as a share of them: a full-width parallel region waits for its
slowest thread, so one busy process stalls it however many cores there are (on 16 cores that
process is 6% of the capacity, and a share limit would let it through). The limit,
:func:`others_limit`, is half a CPU (a process that ran half the window), or 10% of the CPUs where
that is less: on small hosts half a CPU is a large share (a quarter of 2 cores), and 10% keeps
them as sensitive as before (0.2 CPU on 2 cores); from 5 CPUs up half a CPU is the smaller.

A window is judged over ``MIN_WINDOW_S`` at least (:meth:`Meter.stop`), so that the ticks are fine
enough: where the affinity set is every CPU, the summed ``cpu`` line of ``/proc/stat`` is read
(the kernel sums nanoseconds before rounding to a tick, so its error is one tick, not one per CPU).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

# The limits of :func:`judge`: other work's CPUs must reach the smaller of OTHERS_SHARE of the
# CPUs and OTHERS_CPUS_CAP (why in CPUs: the module docstring); pressure, a share of wall time.
OTHERS_SHARE = 0.10
OTHERS_CPUS_CAP = 0.5
PRESSURE_LIMIT = 0.10
# The shortest window :class:`Meter` judges: long enough that the ticks given up are small beside
# the limits; a shorter timing is followed by a look at the CPUs (this process asleep).
MIN_WINDOW_S = 0.25


def others_limit(cpus: int) -> float:
    """The CPUs other work must hold for :func:`judge` to call a window contended on ``cpus`` CPUs:
    ``min(OTHERS_SHARE * cpus, OTHERS_CPUS_CAP)``."""
    return min(OTHERS_SHARE * cpus, OTHERS_CPUS_CAP)


@dataclass(frozen=True)
class CpuSample:
    """One reading of the counters :func:`judge` compares.

    ``wall_s``: a monotonic clock; ``own_cpu_s``: this process's CPU time, all its threads;
    ``cpus``: how many CPUs it may run on; ``idle_s``: their idle + iowait time summed (None where
    ``/proc/stat`` cannot be read); ``tick_s``: the resolution of ``idle_s`` per CPU;
    ``pressure_s``: ``/proc/pressure/cpu``'s "some" total in seconds (None without PSI);
    ``idle_lines``: how many ``/proc/stat`` lines ``idle_s`` sums (each can be off by a tick).
    """

    wall_s: float
    own_cpu_s: float
    cpus: int
    idle_s: Optional[float]
    tick_s: float
    pressure_s: Optional[float]
    idle_lines: int


def _affinity() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _idle_seconds(cpus: set, tick_s: float) -> tuple:
    """Idle + iowait time of ``cpus`` from ``/proc/stat`` (fields 4 and 5 of the ``cpuN`` lines, or
    of the summed ``cpu`` line where ``cpus`` is every CPU listed) and how many lines it sums;
    ``(None, 0)`` where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None, 0
    total, seen, listed, summed = 0, 0, set(), None
    for line in lines:
        name, _, rest = line.partition(" ")
        if name == "cpu":
            fields = rest.split()
            summed = int(fields[3]) + int(fields[4])
        elif name.startswith("cpu") and name[3:].isdigit():
            listed.add(int(name[3:]))
            if int(name[3:]) in cpus:
                fields = rest.split()
                total += int(fields[3]) + int(fields[4])
                seen += 1
    if summed is not None and listed == cpus:
        return summed * tick_s, 1
    return (total * tick_s, seen) if seen == len(cpus) else (None, 0)


def _pressure_seconds() -> Optional[float]:
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some "):
                    for field in line.split():
                        if field.startswith("total="):
                            return int(field[6:]) * 1e-6
    except (OSError, ValueError):  # no PSI (not Linux, older than 4.20, or psi=0: EOPNOTSUPP)
        return None
    return None


def read_cpu_sample() -> CpuSample:
    """The counters now, from ``/proc`` (fields that cannot be read are None)."""
    cpus = _affinity()
    try:
        tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        tick_s = 0.01
    idle_s, idle_lines = _idle_seconds(cpus, tick_s)
    return CpuSample(wall_s=time.perf_counter(), own_cpu_s=time.process_time(), cpus=len(cpus),
                     idle_s=idle_s, tick_s=tick_s, pressure_s=_pressure_seconds(), idle_lines=idle_lines)


def judge(before: CpuSample, after: CpuSample) -> dict:
    """What happened on the CPUs between two samples.

    Returns ``seconds`` (the window), ``others_cpus`` (lower bound of the CPUs busy with other
    work, on average over the window; None where ``/proc/stat`` is unreadable), ``others_share``
    (the same over the CPUs, 0 to 1), ``pressure_share`` (share of the window with a task waiting
    for a CPU; None without PSI) and ``contended``: True when ``others_cpus >=
    others_limit(cpus)`` and (where PSI exists) ``pressure_share >= PRESSURE_LIMIT``; None when
    not even ``others_cpus`` is known.
    """
    seconds = max(after.wall_s - before.wall_s, 1e-9)
    others = share = pressure = None
    if before.idle_s is not None and after.idle_s is not None:
        busy = seconds * after.cpus - (after.idle_s - before.idle_s)
        own = after.own_cpu_s - before.own_cpu_s
        resolution = 2 * max(before.idle_lines, after.idle_lines) * after.tick_s
        others = min(float(after.cpus), max(0.0, (busy - own - resolution) / seconds))
        share = others / after.cpus
    if before.pressure_s is not None and after.pressure_s is not None:
        pressure = min(1.0, max(0.0, (after.pressure_s - before.pressure_s) / seconds))
    contended = None
    if others is not None:
        contended = others >= others_limit(after.cpus) and (pressure is None or pressure >= PRESSURE_LIMIT)
    return {"seconds": seconds, "others_cpus": others, "others_share": share, "pressure_share": pressure,
            "contended": contended}


class Meter:
    """Contention of timed windows: ``start()`` before, ``stop(token)`` after (:func:`judge`'s
    dict). ``reader`` returns :class:`CpuSample` readings (tests pass a fake one) and ``sleep``
    waits (tests pass one that only advances the fake clock)."""

    def __init__(self, reader: Callable[[], CpuSample] = read_cpu_sample,
                 sleep: Callable[[float], None] = time.sleep):
        self.reader = reader
        self.sleep = sleep

    def start(self) -> CpuSample:
        return self.reader()

    def stop(self, token: CpuSample) -> dict:
        """:func:`judge` from ``token`` (what :meth:`start` returned) to now, the window first
        stretched to ``MIN_WINDOW_S`` by sleeping."""
        now = self.reader()
        if now.wall_s - token.wall_s < MIN_WINDOW_S:
            self.sleep(MIN_WINDOW_S - (now.wall_s - token.wall_s))
            now = self.reader()
        return judge(token, now)

    def quiet_window(self, seconds: float) -> dict:
        """:func:`judge` over ``seconds`` of this process sleeping (so its own work adds nothing)."""
        token = self.start()
        self.sleep(seconds)
        return self.stop(token)

    def settle(self, max_wait_s: float, window_s: float = 1.0) -> dict:
        """Wait until a ``window_s`` window is not contended, for at most ``max_wait_s`` seconds.

        Returns ``waited_s`` (seconds spent in windows), ``settled`` (the last window not found
        contended) and ``last`` (that window's :func:`judge`). ``max_wait_s`` 0 looks once.
        """
        waited, last = 0.0, None
        while True:
            last = self.quiet_window(window_s)
            waited += last["seconds"]
            if last["contended"] is not True or waited >= max_wait_s:
                return {"waited_s": waited, "settled": last["contended"] is not True, "last": last}
