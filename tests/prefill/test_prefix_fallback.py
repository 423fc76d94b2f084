"""A prefix that cannot be loaded from the store is recomputed, not a failed request (issue #15):
the store dies (or a block vanishes) before or midway through the layer-by-layer load, and the
tokens still equal the reference; the result and /metrics say nothing was reused."""

from __future__ import annotations

import pytest
import torch

from mooncake_lite.common.protocol import GenerateRequest, PrefillRequest, Sampling
from mooncake_lite.model.generate import reference_greedy
from mooncake_lite.model.weights import build_model
from mooncake_lite.prefill.app import figures
from mooncake_lite.prefill.store_io import MemoryStore
from tests.pd.harness import cluster
from tests.pd.test_inprocess import assert_clean

pytestmark = pytest.mark.timeout(120)
BS = 8


class DyingStore(MemoryStore):
    """A MemoryStore whose loads start failing once ``dies_at_layer`` is asked for."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.dies_at_layer: int | None = None
        self.error: BaseException = ConnectionResetError("store connection lost")

    def __bool__(self) -> bool:      # an empty one still counts as given (the harness's ``store or ...``)
        return True

    async def get_layers(self, keys, first_layer, num_layers, out=None):
        if self.dies_at_layer is not None and first_layer >= self.dies_at_layer:
            raise self.error
        return await super().get_layers(keys, first_layer, num_layers, out=out)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=5)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dies_at_layer, error, chunk", [
    (0, ConnectionRefusedError("refused"), 16),      # dead before the first layer's load
    (2, ConnectionResetError("lost"), 16),           # dies midway: layers 0-1 came from the store
    (3, KeyError("block evicted"), 5),               # a block vanished; several chunks follow
])
async def test_a_failed_prefix_load_is_recomputed_and_the_tokens_are_the_reference(model, dies_at_layer,
                                                                                   error, chunk):
    args = model.args
    store = DyingStore((0, args.num_layers), 2 * BS * args.num_kv_heads * args.head_dim * 4)
    shared = _prompt(3 * BS, 1)
    first, second = shared + _prompt(5, 2), shared + _prompt(BS + 3, 3)
    async with cluster(model, block_size=BS, chunk=chunk, store=store) as c:
        got, _, err = await c.request("warm", first, 4)
        assert err is None and got == reference_greedy(model, first, 4)
        await c.prefill.stage.drain_puts()
        assert len(store) == 3                       # the shared blocks are in the store
        store.dies_at_layer, store.error = dies_at_layer, error
        got, reason, err = await c.request("hit", second, 6)
        assert (reason, err) == ("length", None)
        assert got == reference_greedy(model, second, 6)
        stats = figures(c.prefill)
        assert stats["prefix_load_fallbacks_total"] == 1
        assert stats["prefix_tokens_recomputed_total"] == 3 * BS
        # nothing was really reused: the second request's prefix counts as computed
        assert stats["prefix_tokens_total"] == 0
        assert stats["computed_tokens_total"] == len(first) + len(second)
        await c.prefill.stage.drain_puts()
        assert_clean(c)


async def test_the_result_reports_no_reuse_after_a_fallback(model):
    args = model.args
    store = DyingStore((0, args.num_layers), 2 * BS * args.num_kv_heads * args.head_dim * 4)
    prompt = _prompt(2 * BS + 3, 7)
    async with cluster(model, block_size=BS, store=store) as c:
        await c.request("warm", prompt, 1)
        await c.prefill.stage.drain_puts()
        store.dies_at_layer = 1
        events = c.decode.add_request(GenerateRequest("b", "t-b", len(prompt), Sampling(max_tokens=1)))
        res = await c.prefill.prefill(PrefillRequest("b", "t-b", tuple(prompt), c.data, Sampling(max_tokens=1)))
        assert (res.num_prefix_tokens, res.num_computed_tokens) == (0, len(prompt))
        assert res.first_token == reference_greedy(model, prompt, 1)[0]
        ev = await events.get()
        assert ev.finish_reason == "length" and ev.error is None
