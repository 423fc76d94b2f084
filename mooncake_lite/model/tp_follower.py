"""A tensor-parallel instance's rank > 0: it does each step its rank 0 describes
(``model/tp_step.py`` says what the steps are and how rank 0 leads them)."""

from __future__ import annotations

import logging

import orjson
import torch
import torch.distributed as dist

from mooncake_kernels.quant_linear import float_activations
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout
from mooncake_lite.model.tp_comms import TPComms
from mooncake_lite.model.tp_kv import FRAME_HEADS, PACKED_HEADS, my_heads, prefix_slots
from mooncake_lite.model.tp_step import flag, meta_from_json

log = logging.getLogger(__name__)


class Follower:
    """A rank > 0: does each step rank 0 describes, until ``stop`` (or the leader is gone)."""

    def __init__(self, comms: TPComms, runner: ModelRunner, layout: TPLayout, streams=None, store=None):
        self.comms, self.runner, self.layout = comms, runner, layout
        # This rank's data connections (``transfer/rank_streams.RankStreams``: send, end, drop)
        # and store (``prefill/rank_store.RankStore``: fetch, loaded, put), given by the
        # instance, as the model layer knows no network
        self.streams, self.store = streams, store
        self.model = runner.model
        self.passes: dict[int, list] = {}   # pass number -> [metadata, rope, hidden states]

    def _received(self, shape: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype or self.runner.dtype, device=self.runner.device)
        dist.broadcast(t, src=0, group=self.comms.group)
        return t

    @torch.no_grad()
    def run(self) -> None:
        while True:
            header = orjson.loads(self.comms.broadcast_bytes(None))
            for key in header["drop"]:
                self.passes.pop(key, None)
            if header["op"] == "stop":
                return
            with float_activations(header.get("exact", False)):
                getattr(self, "_" + header["op"])(header)

    def _tick(self, header: dict) -> None:
        pass

    def _layer(self, h: dict) -> None:
        if "meta" in h:
            meta = meta_from_json(h["meta"], self.runner.device)
            hidden = self._received([h["rows"], self.layout.args.dim])
            self.passes[h["pass"]] = [meta, self.model.rope(meta.positions), hidden]
        p = self.passes[h["pass"]]
        p[2] = self.model.layer_forward(h["layer"], p[2], p[1], p[0], self.runner.cache)

    def _head(self, h: dict) -> None:
        self.model.head(self._received([h["rows"], self.layout.args.dim]))

    def _pack(self, h: dict) -> None:
        self.model.pack_()

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.long, device=self.runner.device)

    def _gather_kv(self, h: dict) -> None:
        self.comms.all_gather(self.runner.gather_kv(h["layer"], self._ints(h["slots"])))

    def _pack_kv(self, h: dict) -> None:
        self.comms.all_gather(self.runner.pack_kv(self._ints(h["ids"])))

    def _send_kv(self, h: dict, slots: torch.Tensor | None = None) -> None:
        kv = self.runner.gather_kv(h["layer"], self._ints(h["slots"]) if slots is None else slots)
        if not self.layout.owns_kv:   # a replicated head: its first holder sends it
            return
        kv, heads = kv.cpu(), self.layout.kv_heads
        for offset, n, route in h["routes"]:
            self.streams.send(route, h["layer"], kv[:, offset:offset + n], heads)   # kv is this step's own

    def _load_kv(self, h: dict) -> None:
        keys, ids, layer = [bytes.fromhex(k) for k in h["keys"]], self._ints(h["ids"]), h["layer"]
        failed = True
        try:
            with self.store.loaded(h["fid"], keys, layer, self.comms.timeout.total_seconds() / 2) as packed:
                if h["next"]:
                    self.store.fetch(h["fid"], keys, layer + 1)
                self.runner.unpack_kv(layer, ids, packed.to(self.runner.device))
            failed = False
        except Exception as exc:   # a block gone, the store gone: rank 0 recomputes the prefix
            log.warning("loading this rank's KV heads of layer %d failed: %r", layer, exc)
        flags = self.comms.all_gather(flag(failed, self.runner.device))
        if not any(f.item() for f in flags):   # sent only once every rank has it (else recomputed)
            self._send_kv(h, prefix_slots(ids, self.runner.block_size))

    def _store_kv(self, h: dict) -> None:
        packed = self.runner.pack_kv(self._ints(h["ids"]))
        if self.layout.owns_kv:   # a replicated head: its first holder writes it
            self.store.put([bytes.fromhex(k) for k in h["keys"]], packed.cpu(), h["first_pos"])

    def _end_kv(self, h: dict) -> None:
        if h["abort"]:
            self.streams.drop(h["tid"])
            error = None
        else:
            # within half the collective timeout rank 0 waits under, so a dead decode fails the stream
            error = self.streams.end(h["tid"], h["first_layer"], h["end_layer"],
                                     self.comms.timeout.total_seconds() / 2)
        self.comms.all_gather(flag(error is not None, self.runner.device))

    def _handed(self, h: dict, dim: int) -> tuple[torch.Tensor, range | None] | None:
        """This rank's part of what rank 0 hands out (:meth:`TPLeaderRunner._handed`), received."""
        part = my_heads(torch.empty(h["shape"], device="meta"), self.layout, dim,
                        range(*h["heads"]) if "heads" in h else None)
        if part is None:
            return None
        mine = torch.empty(part[0].shape, dtype=self.runner.dtype, device=self.runner.device)
        dist.recv(mine, src=0, group=self.comms.group)
        return mine, part[1]

    def _unpack_kv(self, h: dict) -> None:
        self.runner.unpack_kv(h["layer"], self._ints(h["ids"]), self._handed(h, PACKED_HEADS)[0])

    def _scatter_kv(self, h: dict) -> None:
        part = self._handed(h, FRAME_HEADS)
        if part is not None:
            self.runner.scatter_kv(h["layer"], self._ints(h["slots"]), *part)
