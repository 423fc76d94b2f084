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

from mooncake_kernels.copies import Staged
from mooncake_lite.common.tracing import add_to_meta
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.transfer.client import FrameClient, NoAnswer
from mooncake_lite.transfer.kv_layout import HeadRange
from mooncake_lite.transfer.kv_stream import OP_KV_ABORT, OP_KV_END, OP_KV_LAYER, layer_frame_meta
from mooncake_lite.transfer.rank_streams import DecodeLinks, Route, tensor_bytes

__all__ = ["DecodeLinks", "KVSender", "layer_kv", "route_of", "routed", "tensor_bytes"]

log = logging.getLogger(__name__)


class KVSender:
    def __init__(self, client: FrameClient, transfer_id: str, traceparent: str | None = None,
                 senders: tuple[range, ...] | None = None):
        self.client = client
        self.transfer_id = transfer_id
        self.traceparent = traceparent   # the stream's span, in every frame's meta (tracing on)
        # A tensor-parallel instance's ranks that send KV, by their heads (ModelRunner.kv_senders):
        # each layer goes as one frame per rank; a layer rank 0 holds whole (a loaded prefix, a
        # recomputed one, or gathered with ranks_send off) is cut into those frames here.
        self.senders = None if senders is None else tuple(HeadRange(r.start, r.stop) for r in senders)
        # A TP instance whose ranks send their own heads of computed layers (docs/store.md §2f):
        # its leader runner (send_kv, end_kv) and the decode's data address; set by for_runner.
        self.ranks: ModelRunner | None = None
        self.address: str | None = None
        self.error: str | None = None
        self.num_frames = 0
        self.num_bytes = 0
        self._inflight: dict[asyncio.Task, Staged] = {}  # the payload memory outlives the send

    @classmethod
    def for_runner(cls, client: FrameClient, transfer_id: str, runner: ModelRunner, address: str,
                   traceparent: str | None = None) -> KVSender:
        """The stream of ``runner``'s instance to the decode at ``address``: one frame per
        sending rank of a TP instance, sent by each rank itself where the runner lets them."""
        sender = cls(client, transfer_id, traceparent, runner.kv_senders)
        if runner.ranks_send:
            sender.ranks, sender.address = runner, address
        return sender

    def route(self, start: int) -> dict | None:
        """Where the other ranks send their heads of tokens ``start..`` (None: rank 0 sends all)."""
        if self.ranks is None or self.error is not None:
            return None
        return Route(self.transfer_id, self.address, start, self.traceparent).to_json()

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
        if heads is None and self.ranks is not None and t.shape[2] < self.senders[-1].stop:
            heads = self.senders[0]   # a computed layer: rank 0's own heads, the others send theirs
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
        if self.error is None and self.ranks is not None:   # the others' ENDs first: rank 0's completes
            failed = await asyncio.get_running_loop().run_in_executor(
                None, self.ranks.end_kv, self.transfer_id, first_layer, end_layer)
            self.error = "; ".join(failed) or None
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
        if self.ranks is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.ranks.end_kv, self.transfer_id, 0, 0, True)
            except Exception as exc:   # a broken group: the instance restarts whole anyway
                log.debug("abort of transfer %s on the other ranks: %s", self.transfer_id, exc)
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


def route_of(sender: object, start: int) -> dict | None:
    """``sender``'s route for tokens ``start..`` (a profiling or benchmark stream has none)."""
    return sender.route(start) if isinstance(sender, KVSender) else None


def routed(routes: list[tuple[int, int, dict | None]]) -> tuple:
    """The extra argument of a layer's compute: ``(routes,)`` where a rank sends its own heads
    of any of them, else none (the call a one-process instance always made)."""
    return (routes,) if any(route is not None for _, _, route in routes) else ()


def layer_kv(runner: ModelRunner, layer: int, slots: torch.Tensor,
             routes: list[tuple[int, int, dict | None]]) -> torch.Tensor:
    """A computed layer's KV for the frames at ``slots``: with routes (rows ``offset, n`` of
    ``slots`` and where they go), the other ranks send their heads themselves and this is rank
    0's; else every head, gathered."""
    routed = [(offset, n, route) for offset, n, route in routes if route is not None]
    return runner.send_kv(layer, slots, routed) if routed else runner.gather_kv(layer, slots)
