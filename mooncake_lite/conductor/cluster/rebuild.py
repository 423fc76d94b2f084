"""When a conductor's view is complete after a start, for its ``/health`` (503 until then).

A conductor that starts (or restarts) knows nothing: its instances register again at their next
heartbeat (a 404 tells them to), its stores sync in full at their next post. Until then a
balancer must not send it traffic. With ``--discovery`` it knows whom to wait for: every
instance and store listed in etcd; without it it can only wait. Either way the wait is bounded
(``--rebuild-wait``): an instance listed in etcd that died before its lease ran out must not
keep the conductor out of rotation. Pure: ``now`` is passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class Rebuild:
    started: float
    wait_s: float
    expected_instances: set[str] = field(default_factory=set)
    expected_stores: set[str] = field(default_factory=set)
    listed: bool = False          # etcd's lists were read (with discovery; without, nothing to list)
    done_at: float | None = None
    how: str = ""

    def expect(self, instances: Collection[str], stores: Collection[str]) -> None:
        """Wait for these too (the entries in etcd while the view is being rebuilt)."""
        if self.done_at is None:
            self.expected_instances.update(instances)
            self.expected_stores.update(stores)
            self.listed = True

    def missing(self, registered: Callable[[str], bool], synced: Callable[[str], bool]) -> list[str]:
        return ([i for i in sorted(self.expected_instances) if not registered(i)]
                + [s for s in sorted(self.expected_stores) if not synced(s)])

    def complete(self, now: float, registered: Callable[[str], bool], synced: Callable[[str], bool]) -> bool:
        """Whether the view is rebuilt: everything expected has reported (with the lists read), or
        the wait is over. Once true, true for good (logged once)."""
        if self.done_at is not None:
            return True
        if self.listed and not self.missing(registered, synced):
            self._done(now, f"every instance ({len(self.expected_instances)}) and store "
                            f"({len(self.expected_stores)}) listed in etcd reported")
        elif now - self.started >= self.wait_s:
            left = self.missing(registered, synced)
            self._done(now, f"the {self.wait_s:g}s wait is over"
                       + (f"; still missing {', '.join(left)}" if left else ""))
        return self.done_at is not None

    def _done(self, now: float, how: str) -> None:
        self.done_at, self.how = now, how
        log.info("view rebuilt %.2fs after start: %s; /health answers 200 from now on", now - self.started, how)
