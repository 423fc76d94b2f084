"""One tensor-parallel instance's steps: rank 0 leads, the other ranks follow.

Rank 0 runs the instance (HTTP, scheduling, KV transfer) and drives its sharded model as any
instance drives its model. Before each piece of work that involves the other ranks it broadcasts
a step description (one orjson object: an op and its integers; tensors follow as raw broadcasts
or point-to-point sends, no pickle) and then does its share; each follower
(``model/tp_follower.py``) reads the description and does the same share, so every collective
meets its peers. The ops are a layer of a pass (the
pass's metadata and input hidden states go along on its first layer; after that every rank holds
the same hidden states, which the all-reduces keep identical), the head, packing the weights, and
moving KV in and out of the paged cache.

KV of a computed layer leaves a prefill from every rank that holds it (``send_kv``): each
follower sends its heads' slice to the decode on its own data connections (the instance gives it
``transfer/rank_streams.RankStreams``), rank 0 sends its own, and ``end_kv`` has every follower
wait for its answers and send its END before rank 0's END, with the first token, completes the
stream (docs/store.md §2f). Where each follower has a store of its own
(:attr:`TPLeaderRunner.ranks_store`), it also reads its heads of a cached prefix (``load_kv``,
sending them on like computed ones once every rank has its own) and writes its heads of new
blocks (``store_kv``). Otherwise rank 0 gathers the ranks' heads of whole blocks to write to the
store (a replicated KV head from one rank only, :attr:`TPLayout.owns_kv`) as one head slice per
writing rank (:attr:`TPLeaderRunner.kv_senders`), and hands each rank its part of a prefix it
read; it always hands each rank its part of what it receives (all heads, or a frame of a head
sub-range from one rank of a TP prefill): only its heads, sent to it alone, none to a rank
holding none of them.
:attr:`TPLeaderRunner.gathered_bytes` counts what came through rank 0.

An idle leader broadcasts a ``tick`` at a third of the group's timeout, so a follower tells an
idle leader from a dead one: a follower whose broadcast times out exits, and a collective that
fails on the leader (a follower died or hung) breaks the group: :attr:`TPLeader.broken` says why,
every later step raises it, and the instance (``instance/tp_ranks.py``) restarts whole.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable

import orjson
import torch
import torch.distributed as dist

from mooncake_kernels.quant_linear import float_activations_on
from mooncake_lite.common.tp_split import kv_head_range, writes_kv
from mooncake_lite.model.llama import AttentionMetadata, Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout, build_sharded_model
from mooncake_lite.model.tp_kv import FRAME_HEADS, PACKED_HEADS, my_heads, owners, prefix_slots
from mooncake_lite.model.tp_comms import TPComms

_META_INTS = ("positions", "slot_mapping", "block_tables", "context_lens")


class TPBrokenError(RuntimeError):
    """The tensor-parallel group can no longer step: a rank died, hung or failed."""


def meta_to_json(meta: AttentionMetadata) -> dict:
    out = {name: getattr(meta, name).tolist() for name in _META_INTS}
    return out | {"is_prefill": meta.is_prefill, "start_pos": meta.start_pos, "segments": meta.segments}


def meta_from_json(d: dict, device: torch.device) -> AttentionMetadata:
    ints = {name: torch.as_tensor(d[name], dtype=torch.long, device=device) for name in _META_INTS}
    segments = tuple(tuple(s) for s in d["segments"]) if d["segments"] is not None else None
    return AttentionMetadata(is_prefill=d["is_prefill"], start_pos=d["start_pos"], segments=segments, **ints)


class TPLeader:
    """Rank 0's side: each step's description and share, one step at a time (a lock: the idle
    ticker is a second thread), and the group's state."""

    def __init__(self, comms: TPComms, layout: TPLayout):
        self.comms, self.layout = comms, layout
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._next_pass = 0
        self._dropped: list[int] = []
        self._last_step = time.monotonic()
        self._ticker: threading.Thread | None = None
        self._stopping = threading.Event()
        self.on_broken: Callable[[str], None] | None = None   # the instance's: restart whole

    def step(self, header: dict, work: Callable[[], object]) -> object:
        """Broadcast ``header`` (with the passes forgotten since), then ``work()``: rank 0's share."""
        with self._lock:
            if self.broken is not None:
                raise TPBrokenError(self.broken)
            # "exact": this step runs within float_activations (a request reporting logprobs):
            # every rank's products must keep float activations, not rank 0's alone.
            header = header | {"drop": self._dropped, "exact": float_activations_on()}
            self._dropped = []
            try:
                self.comms.broadcast_bytes(orjson.dumps(header))
                return work()
            except (RuntimeError, dist.DistBackendError) as exc:   # a peer died, hung past the timeout
                self.break_(f"tensor-parallel step {header['op']!r} failed: {exc}")
                raise TPBrokenError(self.broken) from exc
            finally:
                self._last_step = time.monotonic()

    def break_(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            if self.on_broken is not None:
                self.on_broken(reason)

    def pass_key(self, meta: AttentionMetadata) -> tuple[int, bool]:
        """(the pass's number, whether the followers have yet to hear of it)."""
        key = getattr(meta, "tp_pass", None)
        if key is not None:
            return key, False
        key, self._next_pass = self._next_pass, self._next_pass + 1
        meta.tp_pass = key
        weakref.finalize(meta, self._dropped.append, key)
        return key, True

    def start_ticker(self) -> None:
        interval = self.comms.timeout.total_seconds() / 3

        def tick() -> None:
            while not self._stopping.wait(interval / 2):
                if time.monotonic() - self._last_step >= interval and self.broken is None:
                    try:
                        self.step({"op": "tick"}, lambda: None)
                    except TPBrokenError:
                        return
        self._ticker = threading.Thread(target=tick, name="tp-ticker", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        """Tell the followers to exit (where the group still works) and stop ticking."""
        self._stopping.set()
        if self.broken is None:
            try:
                self.step({"op": "stop"}, lambda: None)
            except TPBrokenError:
                return
            self.broken = "the tensor-parallel group stopped"


class LeaderTransformer(Transformer):
    """Rank 0's sharded model: every layer, head and packing first tells the followers."""

    leader: TPLeader

    def layer_forward(self, layer, h, rope, meta, cache):
        key, new = self.leader.pass_key(meta)
        header = {"op": "layer", "layer": layer, "pass": key}
        if new:
            header |= {"meta": meta_to_json(meta), "rows": h.shape[0]}

        def work():
            if new:
                dist.broadcast(h.contiguous(), src=0, group=self.leader.comms.group)
            return super(LeaderTransformer, self).layer_forward(layer, h, rope, meta, cache)
        return self.leader.step(header, work)

    def head(self, h):
        def work():
            dist.broadcast(h.contiguous(), src=0, group=self.leader.comms.group)
            return super(LeaderTransformer, self).head(h)
        return self.leader.step({"op": "head", "rows": h.shape[0]}, work)

    def pack_(self):
        return self.leader.step({"op": "pack"}, super().pack_)


class TPLeaderRunner(ModelRunner):
    """Rank 0's runner: the whole model's shapes in ``args`` (what the instance registers and
    sends), this rank's share in its cache; KV moves in and out through the followers too."""

    def __init__(self, model: LeaderTransformer, layout: TPLayout, *, num_blocks: int, block_size: int):
        super().__init__(model, num_blocks=num_blocks, block_size=block_size)
        self.args, self.layout, self.leader = layout.args, layout, model.leader
        # Every rank's layout, made once: _handed cuts each follower's heads with it every step
        self.rank_layouts = tuple(dataclasses.replace(layout, rank=r) for r in range(layout.size))
        # Bytes of the other ranks' KV rank 0 received through all_gather: of layers to send
        # (gather_kv) and of whole blocks to write to the store (pack_kv); and of KV it broadcast
        # for them to write (handed: a loaded prefix's, a received frame's; once per follower)
        self.gathered_bytes = {"gather_kv": 0, "pack_kv": 0, "handed": 0}

    # Whether the followers send their own heads of computed layers (send_kv), or rank 0 gathers
    # them (gather_kv) as before: off only to measure what the gather cost (bench model --tp).
    ranks_send = True

    def _gathered(self, header: dict, local: Callable[[], torch.Tensor], dim: int) -> torch.Tensor:
        def work() -> torch.Tensor:
            parts = self.leader.comms.all_gather(local())
            self.gathered_bytes[header["op"]] += sum(p.nbytes for p in parts[1:])
            return owners(parts, self.layout, dim)
        return self.leader.step(header, work)

    def send_kv(self, layer: int, slots: torch.Tensor, routes: list[tuple[int, int, dict]]) -> torch.Tensor:
        """Rank 0's own heads of ``layer`` at ``slots``; every other rank that sends KV sends
        its heads' part of each route ``(offset, n, route)`` (rows ``offset..offset+n`` of
        ``slots``, ``transfer/rank_streams.Route``'s JSON) to its decode on its own connection."""
        return self.leader.step({"op": "send_kv", "layer": layer, "slots": slots.tolist(), "routes": routes},
                                lambda: super(TPLeaderRunner, self).gather_kv(layer, slots))

    def end_kv(self, tid: str, first_layer: int, end_layer: int, abort: bool = False) -> list[str]:
        """Every follower's stream of ``tid`` ended: its frames answered and its END sent (or,
        with ``abort``, dropped). The failures, as "rank r: reason"."""
        header = {"op": "end_kv", "tid": tid, "first_layer": first_layer, "end_layer": end_layer, "abort": abort}

        def work() -> list[str]:
            failed = self.leader.comms.all_gather(flag(False, self.device))
            return [f"tensor-parallel rank {r} could not send its KV heads (its log says why)"
                    for r, f in enumerate(failed) if int(f.item())]
        return self.leader.step(header, work)

    def gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self._gathered({"op": "gather_kv", "layer": layer, "slots": slots.tolist()},
                              lambda: super(TPLeaderRunner, self).gather_kv(layer, slots), FRAME_HEADS)

    def pack_kv(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self._gathered({"op": "pack_kv", "ids": block_ids.tolist()},
                              lambda: super(TPLeaderRunner, self).pack_kv(block_ids), PACKED_HEADS)

    # Whether each follower has a store of its own (instance/tp_ranks.RankPlan.rank_store): then
    # it reads its heads of a prefix (load_kv) and writes its heads of new blocks (store_kv).
    ranks_store = False

    def load_kv(self, layer: int, block_ids: torch.Tensor, own: torch.Tensor, keys: list[bytes], fid: str,
                next_layer: bool, routes: list[tuple[int, int, dict]]) -> None:
        """A loaded prefix's ``layer`` of blocks ``block_ids`` (of store ``keys``): rank 0 writes
        ``own``, its heads (a frame ``[2, tokens, heads, head_dim]``);
        every follower reads its heads of the layer from its store (``fid``: the load; with
        ``next_layer`` it starts reading the next one) and writes them, then, once every rank has,
        sends its share of them along ``routes``. KeyError naming the ranks that could not."""
        header = {"op": "load_kv", "layer": layer, "ids": block_ids.tolist(), "keys": [k.hex() for k in keys],
                  "fid": fid, "next": next_layer, "routes": routes}

        def work() -> None:
            ModelRunner.scatter_kv(self, layer, prefix_slots(block_ids, self.block_size), own)
            failed = [r for r, f in enumerate(self.leader.comms.all_gather(flag(False, self.device))) if f.item()]
            if failed:
                raise KeyError(f"tensor-parallel rank(s) {failed} could not load their KV heads of layer "
                               f"{layer} from the store (their logs say why)")
        self.leader.step(header, work)

    def store_kv(self, block_ids: torch.Tensor, keys: list[bytes], first_pos: int) -> torch.Tensor:
        """Whole blocks to write back: every follower writes its heads of them to its store itself;
        rank 0's heads are returned for its own put."""
        header = {"op": "store_kv", "ids": block_ids.tolist(), "keys": [k.hex() for k in keys], "first_pos": first_pos}
        return self.leader.step(header, lambda: ModelRunner.pack_kv(self, block_ids))

    @property
    def kv_senders(self) -> tuple[range, ...]:
        return tuple(kv_head_range(self.args.num_kv_heads, self.layout.size, r) for r in range(self.layout.size)
                     if writes_kv(self.args.num_kv_heads, self.layout.size, r))

    def _handed(self, header: dict, data: torch.Tensor, write: Callable[[torch.Tensor, range | None], None],
                dim: int, heads: range | None = None) -> None:
        """Hand each rank its part of ``data`` (the instance's KV heads ``heads``, default all),
        point to point, and none to a rank holding none of those heads; each writes its part."""
        data = data.to(self.dtype).contiguous()
        if heads is not None:
            header |= {"heads": [heads.start, heads.stop]}

        def work() -> None:
            for r in range(1, self.layout.size):
                theirs = my_heads(data, self.rank_layouts[r], dim, heads)
                if theirs is not None:
                    dist.send(theirs[0].contiguous(), dst=r, group=self.leader.comms.group)
                    self.gathered_bytes["handed"] += theirs[0].nbytes
            part = my_heads(data, self.layout, dim, heads)
            if part is not None:
                write(*part)
        self.leader.step(header | {"shape": list(data.shape)}, work)

    def unpack_kv(self, layer: int, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
        self._handed({"op": "unpack_kv", "layer": layer, "ids": block_ids.tolist()}, packed,
                     lambda mine, _: super(TPLeaderRunner, self).unpack_kv(layer, block_ids, mine), PACKED_HEADS)

    def scatter_kv(self, layer: int, slots: torch.Tensor, data: torch.Tensor, heads: range | None = None) -> None:
        self._handed({"op": "scatter_kv", "layer": layer, "slots": slots.tolist()}, data,
                     lambda mine, local: super(TPLeaderRunner, self).scatter_kv(layer, slots, mine, local),
                     FRAME_HEADS, heads)


def flag(value: bool, device: torch.device) -> torch.Tensor:
    """A rank's yes/no for an all-gather (whether its part of a step failed)."""
    return torch.tensor([int(value)], dtype=torch.int64, device=device)


def build_rank_runner(spec: str, comms: TPComms, layout: TPLayout, *, num_blocks: int, block_size: int,
                      device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      layer_range: tuple[int, int] | None = None, seed: int = 0) -> ModelRunner:
    """This rank's runner: rank 0's leads (a :class:`TPLeaderRunner`), the others' are plain
    runners a :class:`Follower` drives."""
    lead = layout.rank == 0
    model = build_sharded_model(spec, layout, comms, device=device, dtype=dtype, layer_range=layer_range,
                                seed=seed, cls=LeaderTransformer if lead else Transformer)
    if not lead:
        return ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
    model.leader = TPLeader(comms, layout)
    return TPLeaderRunner(model, layout, num_blocks=num_blocks, block_size=block_size)
