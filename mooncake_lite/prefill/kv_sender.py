"""Streaming one request's KV to its decode instance (wire format in ``transfer/kv_stream.py``).

Frames are pipelined: ``send_layer`` queues a frame and returns at once, so the next layer computes
while this one is on the wire; the answers are checked as they come back. The first refused or
lost frame sets :attr:`KVSender.error`, which the prefill checks between layers to abandon a
request whose decode instance is gone or no longer waits for it. Every frame has a deadline
(``DecodeLinks``' ``request_timeout_s``): a decode on a cut-off node fails the stream with an
error naming it and the op ("decode 10.0.0.4:7003 kv_layer: no answer in 10 s"), and the
connection is dropped so the next request dials afresh.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from kernels.copies import Staged
from mooncake_lite.common.tracing import add_to_meta
from mooncake_lite.transfer.client import FrameClient, NoAnswer, split_address
from mooncake_lite.transfer.kv_layout import HeadRange
from mooncake_lite.transfer.kv_stream import OP_KV_ABORT, OP_KV_END, OP_KV_LAYER, layer_frame_meta
from mooncake_lite.transfer.peers import PeerClients

log = logging.getLogger(__name__)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, without copying (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class DecodeLinks:
    """One framed connection per decode data address, opened on first use and reopened if lost."""

    def __init__(self, token: str | None, connect_timeout_s: float = 5.0, request_timeout_s: float = 10.0):
        self.token = token
        self.timeout = connect_timeout_s
        self.request_timeout = request_timeout_s   # decode answers each frame on arrival: far below this
        self._links: PeerClients[str, FrameClient] = PeerClients(self._connect)

    async def get(self, address: str) -> FrameClient:
        return await self._links.get(address)

    async def _connect(self, address: str) -> FrameClient:
        host, port = split_address(address)
        client = await FrameClient.connect(host, port, token=self.token, name="prefill",
                                           timeout=self.timeout, label=f"decode {address}")
        client.request_timeout = self.request_timeout
        return client

    async def close(self) -> None:
        await self._links.close()


class KVSender:
    def __init__(self, client: FrameClient, transfer_id: str, traceparent: str | None = None,
                 senders: tuple[range, ...] | None = None):
        self.client = client
        self.transfer_id = transfer_id
        self.traceparent = traceparent   # the stream's span, in every frame's meta (tracing on)
        # A tensor-parallel instance's ranks that send KV, by their heads (ModelRunner.kv_senders):
        # each layer goes as one frame per rank, the shape a rank's own frame has (rank 0 cuts
        # them from the gathered layer until the ranks send themselves, docs/store.md §2f).
        self.senders = None if senders is None else tuple(HeadRange(r.start, r.stop) for r in senders)
        self.error: str | None = None
        self.num_frames = 0
        self.num_bytes = 0
        self._inflight: dict[asyncio.Task, Staged] = {}  # the payload memory outlives the send

    def send_layer(self, layer: int, start: int, kv: torch.Tensor | Staged, heads: HeadRange | None = None) -> None:
        """Queue K,V ``[2, n, kv_heads, head_dim]`` of ``layer`` for positions ``start..``: a host
        tensor, or a copy still in flight from the device (sent once it has landed; its staging
        buffer is given back once decode has answered the frame). ``heads``: the KV heads ``kv``
        holds when not all the model's (a TP rank's share, ``transfer/tp_heads.py``)."""
        staged = kv if isinstance(kv, Staged) else Staged(kv)
        if self.error is not None:
            staged.release()
            return
        t = staged.tensor
        parts = [(heads, False)] if heads is not None or self.senders is None else [(h, True) for h in self.senders]
        frames = [(add_to_meta(layer_frame_meta(self.transfer_id, layer, start, t.shape[1], h), self.traceparent),
                   h if cut else None) for h, cut in parts]
        self.num_frames += len(frames)
        self.num_bytes += t.nbytes
        self._track(self._send(frames, staged), keep=staged)

    async def _send(self, frames: list[tuple[dict, HeadRange | None]], staged: Staged) -> None:
        """Send one layer as its frames (each cut to its heads where given), all answered."""
        await staged.ready()
        t = staged.tensor
        await asyncio.gather(*(self.client.request(OP_KV_LAYER, meta, [tensor_bytes(
            t if cut is None else t[:, :, cut.start:cut.stop])], what="kv_layer") for meta, cut in frames))
        # Answered: the bytes are out of every socket buffer. On failure or cancellation they
        # might not be, so the buffer is dropped, never reused.
        staged.release()

    async def end(self, first_layer: int, end_layer: int, first_token: int | list[int] | None,
                  resume: dict | None = None) -> None:
        """Wait for every frame's answer, then send END (with the first token from the last stage;
        a list of them, one per choice, for a request of n > 1 choices; and with it ``resume``,
        what the decode continues from: ``StageEngine.resume_point``).
        Raises ConnectionError with the reason if the stream failed."""
        await self.flush()
        if self.error is None:
            meta = add_to_meta({"tid": self.transfer_id, "first_layer": first_layer, "end_layer": end_layer,
                                "first_token": first_token, **(resume or {})}, self.traceparent)
            try:
                await self.client.request(OP_KV_END, meta, what="kv_end")
            except NoAnswer as exc:
                self.client.abort()
                self.error = f"KV stream to decode failed: {exc}"
            except Exception as exc:
                self.error = f"decode refused the end of the KV stream: {exc}"
        if self.error is not None:
            raise ConnectionError(self.error)

    async def flush(self) -> None:
        while self._inflight:
            await asyncio.wait(set(self._inflight))

    async def abort(self, reason: str) -> None:
        """Tell decode to drop the transfer (best effort: decode may be gone already)."""
        for task in list(self._inflight):
            task.cancel()
        try:
            await self.client.request(OP_KV_ABORT, {"tid": self.transfer_id, "reason": reason}, timeout=2.0,
                                      what="kv_abort")
        except Exception as exc:
            log.debug("abort of transfer %s not delivered: %s", self.transfer_id, exc)

    def _track(self, coro, keep: Staged) -> None:
        task = asyncio.ensure_future(coro)
        self._inflight[task] = keep
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._inflight.pop(task, None)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, NoAnswer):
            self.client.abort()   # a cut peer: fail every other frame on it now, not one deadline each
        if exc is not None and self.error is None:
            self.error = f"KV stream to decode failed: {exc}"
            log.warning("transfer %s: %s", self.transfer_id, self.error)
