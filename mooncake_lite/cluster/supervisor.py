"""Start groups of role processes, watch them, restart the ones that die, stop all in drain order.

The supervisor owns every child (an :class:`AsyncRoleProcess`) it started; :meth:`Supervisor.stop_all` is safe to call
at any point (half-started cluster, after a crash, mid-restart, twice) and returns only when every
child has exited, escalating to SIGKILL after ``stop_timeout``. The children run in their own
sessions (a terminal's Ctrl-C reaches only us), so an impatient operator's further stop signals
are passed on by :meth:`Supervisor.escalate`: the second cuts the stopping children's drains
short, the third kills every child left.

While serving, :meth:`Supervisor.watch` either restarts a child that died (with a
:class:`RestartPolicy`: bounded, doubling backoff) on the ports its first run bound, so its peers
find it where they were told it is, or (without one) raises :class:`RoleFailed` for it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from mooncake_lite.cluster.plan import ChildSpec, stop_order
from mooncake_lite.common.launch import AsyncRoleProcess, LineSink, RoleFailed

log = logging.getLogger(__name__)

# Ready-line address → the flag that binds it: a restarted child gets the port its first run bound.
PORT_FLAGS = {"http": "--port", "data": "--data-port"}


@dataclass(frozen=True)
class RestartPolicy:
    """A child that dies while serving comes back after ``first_delay_s``, doubling with each
    death up to ``max_delay_s`` (a crash loop costs little); a child that served ``healthy_after_s``
    before it died starts over from ``first_delay_s``."""
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    healthy_after_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")

    def delay(self, num_recent_restarts: int) -> float:
        """Seconds to wait before the next start, after ``num_recent_restarts`` since it was last healthy."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** min(num_recent_restarts, 32))


def exit_reason(rc: int | None) -> str:
    """A child's exit in words: a signal by name, and a clean exit while serving said to be a stop
    (a role serves until SIGINT/SIGTERM, so code 0 means someone stopped it, not a crash)."""
    if rc is None:
        return "is still running"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"exited with code {rc} (killed by {name})"
    if rc == 0:
        return "exited with code 0 (stopped cleanly: a SIGTERM or SIGINT sent to it, not to mooncake up)"
    return f"exited with code {rc}"


def pinned(argv: Sequence[str], addresses: Mapping[str, str]) -> tuple[str, ...]:
    """``argv`` with each port flag set to the port its run bound (``--port 0`` picked a free one)."""
    out = list(argv)
    for key, flag in PORT_FLAGS.items():
        if key not in addresses:
            continue
        port = addresses[key].rsplit(":", 1)[1]
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = port
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={port}"
    return tuple(out)


class Supervisor:
    def __init__(self, on_line: LineSink, *, stop_timeout: float = 15.0, restart: RestartPolicy | None = None,
                 on_event: Callable[[str], None] | None = None):
        self.on_line, self.stop_timeout, self.restart = on_line, stop_timeout, restart
        self.on_event = on_event or log.warning
        self.children: dict[str, AsyncRoleProcess] = {}
        self.specs: dict[str, ChildSpec] = {}          # how to start each child again (ports pinned)
        self.restarts: Counter[str] = Counter()        # restarts per child name, for status lines
        self._ready_at: dict[str, float] = {}
        self._starting: set[asyncio.Task] = set()      # restarts stop_all must let finish first
        self._stopping: list[AsyncRoleProcess] = []    # the group stop_all is stopping now
        self.is_stopping = False
        self.num_escalations = 0                       # stop signals after the first (escalate)

    async def start_group(self, specs: Sequence[ChildSpec], ready_timeout: float) -> list[AsyncRoleProcess]:
        """Start ``specs`` together and wait for all their ready lines (RoleFailed otherwise)."""
        group = []
        for spec in specs:
            if spec.name in self.children:
                raise ValueError(f"duplicate child name {spec.name!r}")
            self.specs[spec.name] = spec
            child = self._new_child(spec)
            self.children[spec.name] = child
            await child.start()
            group.append(child)
        await asyncio.gather(*(self._ready(c, ready_timeout) for c in group))
        return group

    def _new_child(self, spec: ChildSpec) -> AsyncRoleProcess:
        return AsyncRoleProcess(spec.name, spec.role, spec.argv, on_line=self.on_line, env=dict(spec.env))

    async def _ready(self, child: AsyncRoleProcess, timeout: float) -> None:
        addresses = await child.wait_ready(timeout)
        self._ready_at[child.name] = time.monotonic()
        spec = self.specs[child.name]
        self.specs[child.name] = replace(spec, argv=pinned(spec.argv, addresses))

    def dead(self) -> list[AsyncRoleProcess]:
        return [c for c in self.children.values() if c.returncode is not None]

    def failure_of(self, child: AsyncRoleProcess) -> RoleFailed:
        return RoleFailed(child.name, exit_reason(child.returncode), child.tail)

    async def watch(self, ready_timeout: float) -> None:
        """While serving: restart each child that dies (with a restart policy) or raise
        :class:`RoleFailed` for the first one (without). Returns only when stopping."""
        tasks = [asyncio.create_task(self._keep(name, ready_timeout)) for name in list(self.children)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise the first failure
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _keep(self, name: str, ready_timeout: float) -> None:
        """Keep child ``name`` running until the supervisor stops."""
        num_recent = 0
        while True:
            child = self.children[name]
            rc = await child.wait_exit()
            if self.is_stopping:
                return
            if self.restart is None:
                raise self.failure_of(child)
            ready_at = self._ready_at.pop(name, None)
            uptime = time.monotonic() - ready_at if ready_at is not None else 0.0
            if uptime >= self.restart.healthy_after_s:
                num_recent = 0
            delay = self.restart.delay(num_recent)
            num_recent += 1
            self.on_event(f"{name} {exit_reason(rc)} after {uptime:.1f}s serving; "
                          f"restart {self.restarts[name] + 1} in {delay:g}s")
            await asyncio.sleep(delay)
            if self.is_stopping:
                return
            await self._restart(name, ready_timeout)

    async def _restart(self, name: str, ready_timeout: float) -> None:
        """Start ``name`` again from its pinned spec; a failed start is left for ``_keep`` to see."""
        child = self._new_child(self.specs[name])
        self.children[name] = child
        self.restarts[name] += 1
        start = asyncio.create_task(child.start())   # stop_all waits for it: no process escapes
        self._starting.add(start)
        start.add_done_callback(self._starting.discard)
        await asyncio.shield(start)
        try:
            await self._ready(child, ready_timeout)
        except RoleFailed as exc:
            self.on_event(f"{name} failed to come back: {exc}")
            await child.stop(self.stop_timeout)
            return
        self.on_event(f"{name} is back: pid {child.pid} (restart {self.restarts[name]})")

    def restart_summary(self) -> str:
        """``decode-0=2, store-0=1``: restarts per child so far ("none" when there were none)."""
        return ", ".join(f"{n}={k}" for n, k in self.restarts.items() if k) or "none"

    async def stop_all(self) -> dict[str, int]:
        """Stop every child, group by group (conductor, instances, stores); exit codes by name."""
        self.is_stopping = True
        await asyncio.gather(*self._starting, return_exceptions=True)
        codes: dict[str, int] = {}
        for group in stop_order(list(self.children)):
            children = self._stopping = [self.children[n] for n in group]
            self.on_event(f"stopping {_names(children)}")
            if self.num_escalations:   # hurried already: both stop signals at once (they do not merge)
                for child in children:
                    child.send(signal.SIGINT)
            results = await asyncio.gather(*(c.stop(self.stop_timeout) for c in children),
                                           return_exceptions=True)
            for child, rc in zip(children, results):
                if isinstance(rc, BaseException):
                    log.error("stopping %s failed: %r", child.name, rc)
                    child.send(signal.SIGKILL)  # SIGKILL as a last resort; never leave it running
                    rc = await child.proc.wait() if child.proc else -9
                codes[child.name] = rc
        self._stopping = []
        return codes

    def escalate(self) -> None:
        """A stop signal after the first (an impatient Ctrl-C). The second sends the children
        stopping now a second SIGTERM, which cuts their drains short (``common/service.serve_app``),
        and those still to stop get SIGINT with their SIGTERM (two signals, as one would merge);
        the third and later SIGKILL every child still running. ``stop_all`` still reaps them all."""
        self.num_escalations += 1
        alive = [c for c in self.children.values() if c.returncode is None]
        if self.num_escalations == 1:
            stopping = [c for c in self._stopping if c.returncode is None]
            for child in stopping:
                child.send(signal.SIGTERM)
            self.on_event(f"a second stop signal: SIGTERM again to {_names(stopping) or 'no child yet'} "
                          "(a drain ends now), the rest get two at once; a third signal kills every process")
            return
        for child in alive:
            child.send(signal.SIGKILL)
        self.on_event(f"another stop signal: SIGKILL to {_names(alive) or 'no child (all exited)'}")


def _names(children: Sequence[AsyncRoleProcess]) -> str:
    return ", ".join(c.name for c in children)
