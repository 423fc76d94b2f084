"""Where a frame's payload lands: the views a handler's ``payload_sink`` gave (slab slots, a
caller's tensor) or one fresh buffer, filled in order as the bytes arrive."""

from __future__ import annotations


class Landing:
    """The payload's views, and how far the bytes received so far reach into them."""
    __slots__ = ("views", "index", "offset")

    def __init__(self, views: list[memoryview]) -> None:
        self.views = [v for v in views if v.nbytes]
        self.index = 0     # the view the next byte goes to
        self.offset = 0    # ... and where in it

    def rest_of_view(self) -> memoryview:
        """The unfilled part of the current view: where the kernel can receive in place."""
        return self.views[self.index][self.offset:]

    def received(self, nbytes: int) -> None:
        """``nbytes`` were received in place (into ``rest_of_view()``)."""
        self.offset += nbytes
        self._skip_full()

    def fill(self, data: memoryview) -> None:
        """Copy ``data`` in (bytes that arrived in the staging buffer)."""
        pos = 0
        n = data.nbytes
        while pos < n:
            view = self.views[self.index]
            take = min(n - pos, view.nbytes - self.offset)
            view[self.offset:self.offset + take] = data[pos:pos + take]
            pos += take
            self.offset += take
            self._skip_full()

    def _skip_full(self) -> None:
        views = self.views
        while self.index < len(views) and self.offset >= views[self.index].nbytes:
            self.offset -= views[self.index].nbytes
            self.index += 1
