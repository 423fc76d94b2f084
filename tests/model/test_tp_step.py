"""Rank 0 drives a sharded model as an instance drives any model; the other ranks follow its
step descriptions. Tokens, logits and the KV that leaves or enters the cache (in the whole
model's layout) equal TP=1's."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import torch

from mooncake_kernels.quant_linear import float_activations, float_activations_on

from mooncake_lite.model.generate import generate
from mooncake_lite.model.runner import LayerwisePass, ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from mooncake_lite.model.tensor_parallel import TPLayout
from mooncake_lite.model.tp_follower import Follower
from mooncake_lite.model.tp_step import TPLeader, build_rank_runner
from mooncake_lite.model.weights import build_model, model_args
from tests.model.tp_ranks import run_ranks

BS = 8
PROMPT = [5, 17, 3, 99, 42, 7, 11, 60, 2, 1, 33, 8, 19]


def _script(runner: ModelRunner) -> dict:
    """What an instance does: a layer-wise prefill streaming each layer's KV, write-back of its
    full blocks, greedy decode steps, and a prefix brought in from packed blocks and from frames."""
    ids = torch.arange(4)
    piece = LayerwisePass(runner, list(range(4)), 0, token_ids=PROMPT)
    frames = []
    for layer in runner.model.layer_ids:
        piece.run_layer(layer)
        frames.append(runner.gather_kv(layer, piece.slots))
    first = int(piece.output().argmax())
    blocks = runner.pack_kv(ids[:1])
    tokens = generate(runner, PROMPT, SamplingParams(max_tokens=6), chunk_size=5)
    runner.unpack_kv(0, ids[2:3], blocks)                 # a prefix block loaded elsewhere
    runner.scatter_kv(1, torch.arange(40, 40 + len(PROMPT)), frames[1])   # a KV frame received
    # The prompt's KV received as head slices (one TP prefill rank's each, the second half of
    # the heads first): every rank holding a head (replicas included) writes it, so a decode
    # step over those blocks gives the same next token.
    kvh, slots = runner.args.num_kv_heads, torch.arange(8 * BS, 8 * BS + len(PROMPT))
    for layer in runner.model.layer_ids:
        for heads in (range(kvh // 2, kvh), range(0, kvh // 2)):
            runner.scatter_kv(layer, slots, frames[layer][:, :, heads.start:heads.stop].contiguous(), heads)
    after = int(runner.decode([first], [[8, 9]], [len(PROMPT)]).argmax())
    assert after == tokens[1]
    return {"first": first, "frames": frames, "blocks": blocks, "tokens": tokens,
            "moved": (runner.pack_kv(ids[2:3]), runner.gather_kv(1, torch.arange(40, 40 + len(PROMPT))))}


def _job(comms, spec: str):
    layout = TPLayout(model_args(spec), comms.size, comms.rank)
    runner = build_rank_runner(spec, comms, layout, num_blocks=16, block_size=BS)
    if comms.rank:
        Follower(comms, runner, layout).run()
        return None
    try:
        return _script(runner)
    finally:
        runner.leader.stop()


def _same(got, ref) -> None:
    assert got["first"] == ref["first"] and got["tokens"] == ref["tokens"]
    for a, b in zip(got["frames"] + [got["blocks"], *got["moved"]], ref["frames"] + [ref["blocks"], *ref["moved"]],
                    strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_leader_and_followers_at_tp2_and_tp4_match_tp1(tmp_path):
    ref = _script(ModelRunner(build_model("tiny"), num_blocks=16, block_size=BS))
    _same(run_ranks(2, _job, "tiny", tmp_path)[0], ref)
    _same(run_ranks(4, _job, "tiny", tmp_path)[0], ref)   # KV heads replicated: each sent once


class _Wire:
    """Stands in for TPComms' header broadcast: rank 0 sends, a follower receives the same."""

    def __init__(self, headers=()):
        self.sent, self.queue = [], list(headers)

    def broadcast_bytes(self, data):
        if data is not None:
            self.sent.append(orjson.loads(data))
            return data
        return orjson.dumps(self.queue.pop(0))


def test_a_step_within_float_activations_runs_so_on_every_rank():
    """A request reporting logprobs keeps float activations (mooncake_kernels.quant_linear): rank 0 says
    so in each step's header, and a follower runs that step within float_activations too."""
    leader = TPLeader(_Wire(), None)
    with float_activations():
        leader.step({"op": "probe"}, lambda: None)
    leader.step({"op": "probe"}, lambda: None)
    assert [h["exact"] for h in leader.comms.sent] == [True, False]

    seen = []

    class Probe(Follower):
        def _probe(self, header):
            seen.append(float_activations_on())

    runner = SimpleNamespace(model=None)
    Probe(_Wire([*leader.comms.sent, {"op": "stop", "drop": []}]), runner, None).run()
    assert seen == [True, False] and not float_activations_on()
