"""Data connections to decode instances: the prefill's (:class:`DecodeLinks`, on its event loop)
and a tensor-parallel follower rank's own (:class:`RankStreams`, docs/store.md §2f).

A follower rank of a TP prefill sends its KV heads' slice of each layer straight to the decode
on connections of its own, so rank 0 no longer gathers every rank's heads to send them. The
follower is a synchronous step loop (``model/tp_step.py``), so its connections live on an event
loop in a thread of their own: :meth:`RankStreams.send` queues a frame and returns at once (the
next step runs while it is on the wire), :meth:`RankStreams.end` waits for every answer and
sends this rank's END, which the decode counts per connection (``decode/engine.py`` joins a
request once every head of every layer has every token and the END with the first token, rank
0's, has come; rank 0 sends it only after every follower's END was answered).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

import torch

from mooncake_lite.common.tracing import add_to_meta
from mooncake_lite.transfer.client import FrameClient, split_address
from mooncake_lite.transfer.kv_layout import HeadRange
from mooncake_lite.transfer.kv_stream import OP_KV_END, OP_KV_LAYER, layer_frame_meta
from mooncake_lite.transfer.peers import PeerClients

log = logging.getLogger(__name__)


class DecodeLinks:
    """One framed connection per decode data address, opened on first use and reopened if lost."""

    def __init__(self, token: str | None, connect_timeout_s: float = 5.0, request_timeout_s: float = 10.0,
                 name: str = "prefill"):
        self.token, self.name = token, name
        self.timeout = connect_timeout_s
        self.request_timeout = request_timeout_s   # decode answers each frame on arrival: far below this
        self._links: PeerClients[str, FrameClient] = PeerClients(self._connect)

    async def get(self, address: str) -> FrameClient:
        return await self._links.get(address)

    async def _connect(self, address: str) -> FrameClient:
        host, port = split_address(address)
        client = await FrameClient.connect(host, port, token=self.token, name=self.name,
                                           timeout=self.timeout, label=f"decode {address}")
        client.request_timeout = self.request_timeout
        return client

    async def close(self) -> None:
        await self._links.close()


@dataclass(frozen=True)
class Route:
    """Where a follower rank sends one request's tokens ``start..``: the step header's form."""
    tid: str
    to: str                      # the decode's data address
    start: int
    traceparent: str | None = None

    def to_json(self) -> dict:
        return {"tid": self.tid, "to": self.to, "start": self.start, "tp": self.traceparent}

    @classmethod
    def from_json(cls, d: dict) -> Route:
        return cls(d["tid"], d["to"], d["start"], d.get("tp"))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without copying (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class RankStreams:
    """A follower rank's KV streams, by transfer id; its own loop thread and connections."""

    def __init__(self, token: str | None, request_timeout_s: float = 10.0):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rank-streams", daemon=True).start()
        self.links = DecodeLinks(token, request_timeout_s=request_timeout_s, name="prefill-rank")
        self._frames: dict[str, list[concurrent.futures.Future]] = {}
        self._to: dict[str, str] = {}

    def send(self, route_json: dict, layer: int, kv: torch.Tensor, heads: range) -> None:
        """Queue K,V ``[2, n, heads, head_dim]`` (host memory, this call's to keep) of ``layer``
        for the request ``route_json`` (a :class:`Route`'s, from the step header) names."""
        route = Route.from_json(route_json)
        meta = add_to_meta(layer_frame_meta(route.tid, layer, route.start, kv.shape[1],
                                            HeadRange(heads.start, heads.stop)), route.traceparent)
        payload = tensor_bytes(kv)
        self._to[route.tid] = route.to
        self._frames.setdefault(route.tid, []).append(asyncio.run_coroutine_threadsafe(
            self._request(route.to, OP_KV_LAYER, meta, [payload], "kv_layer"), self.loop))

    async def _request(self, to: str, op: int, meta: dict, payload: list, what: str) -> None:
        client = await self.links.get(to)
        await client.request(op, meta, payload, what=what)

    def end(self, tid: str, first_layer: int, end_layer: int, within_s: float) -> str | None:
        """Wait for every frame of ``tid`` to be answered, then send this rank's END (no first
        token: rank 0's END carries it); all within ``within_s`` (below the group's collective
        timeout, which rank 0 waits under: a decode that stopped answering fails this stream,
        never the TP group). The first error, or None."""
        frames, to = self._frames.pop(tid, []), self._to.pop(tid, None)
        if to is None:
            return None   # nothing sent (every token of its requests was a loaded prefix)
        deadline = time.monotonic() + within_s
        meta = {"tid": tid, "first_layer": first_layer, "end_layer": end_layer, "first_token": None}
        try:
            for f in frames:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            asyncio.run_coroutine_threadsafe(self._request(to, OP_KV_END, meta, [], "kv_end"),
                                             self.loop).result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:   # refused, lost or unanswered: rank 0 fails the stream with it
            for f in frames:
                f.cancel()
            log.warning("transfer %s: this rank's KV stream failed: %r", tid, exc)
            return f"{type(exc).__name__}: {exc}" if str(exc) else f"no answer from decode {to} in {within_s:g} s"
        return None

    def drop(self, tid: str) -> None:
        """Forget ``tid`` (rank 0 aborted its stream): frames still in flight are cancelled."""
        for f in self._frames.pop(tid, []):
            f.cancel()
        self._to.pop(tid, None)
