"""Start groups of role processes, watch them, and stop all of them in drain order.

The supervisor owns every child (an :class:`AsyncRoleProcess`) it started; :meth:`Supervisor.stop_all` is safe to call
at any point (half-started cluster, after a crash, twice) and returns only when every child
has exited, escalating to SIGKILL after ``stop_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

from mooncake_lite.cluster.plan import ChildSpec, stop_order
from mooncake_lite.common.launch import AsyncRoleProcess, LineSink, RoleFailed

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, on_line: LineSink, *, stop_timeout: float = 15.0):
        self.on_line, self.stop_timeout = on_line, stop_timeout
        self.children: dict[str, AsyncRoleProcess] = {}
        self.is_stopping = False

    async def start_group(self, specs: Sequence[ChildSpec], ready_timeout: float) -> list[AsyncRoleProcess]:
        """Start ``specs`` together and wait for all their ready lines (RoleFailed otherwise)."""
        group = []
        for spec in specs:
            if spec.name in self.children:
                raise ValueError(f"duplicate child name {spec.name!r}")
            child = AsyncRoleProcess(spec.name, spec.role, spec.argv, on_line=self.on_line, env=dict(spec.env))
            self.children[spec.name] = child
            await child.start()
            group.append(child)
        await asyncio.gather(*(c.wait_ready(ready_timeout) for c in group))
        return group

    def dead(self) -> list[AsyncRoleProcess]:
        return [c for c in self.children.values() if c.returncode is not None]

    async def wait_any_exit(self) -> AsyncRoleProcess:
        """Block until some child exits; return it (used to notice crashes while serving)."""
        waits = {asyncio.create_task(c.proc.wait()): c for c in self.children.values() if c.proc}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return waits[next(iter(done))]
        finally:
            for task in waits:
                task.cancel()

    def failure_of(self, child: AsyncRoleProcess) -> RoleFailed:
        return RoleFailed(child.name, f"exited with code {child.returncode}", child.tail)

    async def stop_all(self) -> dict[str, int]:
        """Stop every child, group by group (conductor, instances, stores); exit codes by name."""
        self.is_stopping = True
        codes: dict[str, int] = {}
        for group in stop_order(list(self.children)):
            children = [self.children[n] for n in group]
            results = await asyncio.gather(*(c.stop(self.stop_timeout) for c in children),
                                           return_exceptions=True)
            for child, rc in zip(children, results):
                if isinstance(rc, BaseException):
                    log.error("stopping %s failed: %r", child.name, rc)
                    child.send(signal.SIGKILL)  # SIGKILL as a last resort; never leave it running
                    rc = await child.proc.wait() if child.proc else -9
                codes[child.name] = rc
        return codes
