"""The receive memory a server's connections may hold for frames still arriving, and each one's share."""

from __future__ import annotations

from mooncake_lite.transfer.framing import FrameError


class OverBudget(FrameError):
    """A frame's receive memory would take the server over its in-flight budget."""


class InflightBudget:
    """Receive memory held by frames still arriving, shared by all connections of one server."""
    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int, what: str) -> None:
        if self.used + nbytes > self.limit:
            raise OverBudget(f"a {nbytes}-byte {what} would bring receive buffers to "
                             f"{self.used + nbytes} bytes, over the in-flight budget of {self.limit}")
        self.used += nbytes

    def give(self, nbytes: int) -> None:
        self.used -= nbytes


class BudgetShare:
    """What one connection holds of its server's budget: the frame it is receiving."""
    __slots__ = ("budget", "held")

    def __init__(self, budget: InflightBudget | None) -> None:
        self.budget = budget   # None: fresh receive memory is not accounted (clients)
        self.held = 0

    def charge(self, nbytes: int, what: str) -> None:
        if self.budget is not None and nbytes:
            self.budget.take(nbytes, what)
            self.held += nbytes

    def release(self) -> None:
        if self.held and self.budget is not None:
            self.budget.give(self.held)
        self.held = 0
