"""What this host can give a new process, read from the kernel (used by ``mooncake up``'s division
of the box and by an instance choosing how to hold its weights)."""

from __future__ import annotations

import os


def available_memory(meminfo: str = "/proc/meminfo") -> int:
    """Bytes the kernel says new work can take without swapping (MemAvailable), else free pages."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_ticks(stat: str = "/proc/stat") -> list[int] | None:
    """The machine's CPU time by state, in clock ticks summed over CPUs (``/proc/stat``'s ``cpu``
    line: user, nice, system, idle, iowait, irq, softirq, steal, ...), or None where it cannot be read."""
    try:
        with open(stat) as f:
            label, *fields = f.readline().split()
        return [int(v) for v in fields] if label == "cpu" else None
    except (OSError, ValueError):
        return None


def steal_seconds(stat: str = "/proc/stat") -> float | None:
    """CPU seconds this machine's CPUs were ready to run but the hypervisor ran something else
    (the ``cpu`` line's steal, summed over CPUs), or None where the kernel says nothing of it.
    On a shared VM it is what a noisy neighbour takes: a prefill's chunk beside it runs longer
    than its profile priced (docs/results/2026-12-01-zen3-admission.md §18)."""
    ticks = cpu_ticks(stat)
    return None if ticks is None or len(ticks) < 8 else ticks[7] / os.sysconf("SC_CLK_TCK")


def thread_seconds(tasks: str = "/proc/self/task") -> tuple[float, float] | None:
    """Seconds this process's threads ran on a CPU and waited runnable for one while another task
    of this machine ran (``schedstat``'s first two fields, summed over the threads), or None where
    the kernel keeps no schedstat. Beside :func:`steal_seconds` it says where a slow forward's time
    went: waiting behind this machine's other work (the run queue), taken by the hypervisor (steal),
    or on the CPU but doing less per second (neither)."""
    ran = waited = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"{tasks}/{name}/schedstat") as f:
                fields = f.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue              # a thread that ended between the listing and the read
    return (ran / 1e9, waited / 1e9) if names else None
