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
