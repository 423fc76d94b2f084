"""The prefill -> decode KV stream on the transfer framing: the op codes and frame layouts both
ends share (prefill/kv_sender.py sends, decode/kv_receiver.py receives).

A prefill instance (each stage of a CPP group, each sending rank of a TP instance: its own
heads, ``transfer/rank_streams.py``) opens one framed connection to the decode
instance's data socket (``Register.data``, the ``"data"`` address of its ready line) and sends,
for one request tagged by ``transfer_id`` (``tid``):

    OP_KV_LAYER  meta {"tid", "layer", "start", "n", "kvl", "heads"?}   payload K,V of one layer
                 for tokens start..start+n-1: ``[2][n][heads][head_dim]`` in the model dtype (raw
                 bytes); ``kvl`` is the KV layout version (``transfer/kv_layout.py``; a receiver
                 refuses another), ``heads`` [start, stop) the KV heads the frame carries (absent:
                 all the model's): one TP prefill rank's share (``transfer/tp_heads.py``;
                 docs/store.md §2f); a decode writes each at its heads' place
    OP_KV_END    meta {"tid", "first_layer", "end_layer", "first_token": int | null,
                       "output"?, "key"?, "tail"?}
                 this sender has sent all its layers (a TP follower rank's END, first: no
                 token; then rank 0's); the stage that owns the last layer carries
                 the first token sampled at the last prompt position, and with it what the decode
                 resumes from: ``output`` (a continued request's output so far, the prompt's last
                 ``Sampling.num_generated`` ids), ``key`` (hex of the prompt's last full block's
                 key, or null) and ``tail`` (the prompt's ids after that block), from which the
                 decode keys the blocks its tokens fill (``decode/writeback.py``)
    OP_KV_ABORT  meta {"tid", "reason"}                   the prefill gave up; decode fails the request
    OP_KV_ALIVE  meta {"tid"}                             the request waits in the prefill queue: it
                 counts as progress for decode's inactivity timeout (``kv_timeout_s``)

Layer and end frames of a traced request also carry ``"tp"``, the W3C traceparent of the
prefill's KV stream span (``common/tracing.py``); decode parents its receive span on it.

Every frame is answered (``{"ok": true}`` or an error frame); senders pipeline frames and check
the answers at the end, so a refused transfer (unknown tid, aborted, bad shape) stops the prefill.
Prefix tokens loaded from the store travel the same way as computed ones: decode only needs the
full KV of every prompt position, whatever produced it.

A frame stays token-major (the paged cache's order), unlike a store block: it is one layer of one
sender's heads, sent whole, and the single-rank path sends it without a reordering copy; a sender
cuts a rank's head sub-range from a gathered layer with one strided copy (``kv[:, :, a:b]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake_lite.transfer.kv_layout import LAYOUT_VERSION, META_KEY, HeadRange, check_version, heads_from_meta

if TYPE_CHECKING:   # the op codes are read by the conductor's KV sink, which must not load torch
    import torch

OP_KV_LAYER = 20
OP_KV_END = 21
OP_KV_ABORT = 22
OP_KV_ALIVE = 23


def layer_frame_meta(transfer_id: str, layer: int, start: int, num_tokens: int,
                     heads: HeadRange | None = None) -> dict:
    meta = {"tid": transfer_id, "layer": layer, "start": start, "n": num_tokens, META_KEY: LAYOUT_VERSION}
    if heads is not None:
        meta["heads"] = heads.to_meta()
    return meta


def frame_heads(meta: dict, num_kv_heads: int) -> HeadRange:
    """The KV heads a layer frame carries, after checking its layout version (LayoutError: an
    unknown version, a malformed range). A frame without ``kvl`` is from an older prefill, whose
    frames carried every head in this same token-major order: read as all heads."""
    if META_KEY in meta:
        check_version(meta[META_KEY])
    return heads_from_meta(meta, num_kv_heads)


def token_kv_bytes(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    import torch
    return 2 * num_tokens * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def tensor_from_payload(payload: list[memoryview], num_tokens: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``[2, n, kvh, hd]`` view over the received payload (no copy when it came in one buffer)."""
    import torch
    buf = payload[0] if len(payload) == 1 else memoryview(bytearray(b"".join(payload)))
    flat = torch.frombuffer(buf, dtype=dtype) if buf.nbytes else torch.empty(0, dtype=dtype)
    return flat.view(2, num_tokens, num_kv_heads, head_dim)
