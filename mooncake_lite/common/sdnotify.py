"""systemd's notify protocol (``Type=notify``), in a few lines and no dependency.

systemd gives a service the path of a unix datagram socket in ``NOTIFY_SOCKET`` (a leading
``@`` names one in the abstract namespace) and reads newline-separated ``KEY=VALUE`` states
from it: ``READY=1`` (the unit is started), ``STATUS=...`` (shown by ``systemctl status``),
``STOPPING=1`` (draining), ``WATCHDOG=1`` (alive; with ``WatchdogSec=`` set systemd passes
``WATCHDOG_USEC`` and restarts a service that stays silent that long). Without
``NOTIFY_SOCKET`` (not under systemd) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*states: str) -> bool:
    """Send ``states`` (e.g. ``"READY=1"``, ``"STATUS=serving"``) as one datagram; False when
    there is no socket to send to or the send failed (never raises: a role serves either way)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not states:
        return False
    if address.startswith("@"):             # abstract namespace: a leading NUL byte
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(states).encode(), address)
    except OSError as exc:
        log.debug("sd_notify %s failed: %s", states, exc)
        return False
    return True


def ready(status: str) -> bool:
    """The role can serve now: ``READY=1`` and why (``systemctl start`` returns on it)."""
    return notify("READY=1", f"STATUS={status}")


def watchdog_period() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half the ``WATCHDOG_USEC`` systemd set (so one
    late ping is not a restart), or None when no watchdog is asked of this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not os.environ.get("NOTIFY_SOCKET") or (pid and pid != str(os.getpid())):
        return None
    try:
        period = int(usec) / 2e6
    except ValueError:
        return None
    return period if period > 0 else None


async def watchdog(period: float) -> None:
    """Ping every ``period`` seconds from the event loop (run as a task; cancel to stop): a loop
    wedged by blocking code stops pinging, and systemd restarts the role."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(period)


def start_watchdog() -> asyncio.Task | None:
    """The watchdog task on the running loop (cancel it to stop), or None when no watchdog
    is asked of this process."""
    period = watchdog_period()
    return asyncio.get_running_loop().create_task(watchdog(period), name="sd-watchdog") if period else None
