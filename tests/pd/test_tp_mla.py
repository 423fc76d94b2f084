"""An MLA model with routed experts (``tiny-mla``) served by a TP=2 prefill and a TP=2 decode as
real processes: the latent travels replicated (rank 0's copy sent and written once, every rank
caching it whole) and the greedy tokens are the monolithic model's, prefix reuse included."""

import aiohttp
import pytest

from mooncake_lite.model.weights import build_model
from tests.pd.test_e2e import COMMON, check_prompts, start_many

pytestmark = pytest.mark.timeout(300)
MLA = tuple("tiny-mla" if arg == "tiny" else arg for arg in COMMON)


async def test_tp2_prefill_and_decode_of_an_mla_model_match_the_monolithic_tokens(role_procs):
    decode, prefill = start_many(role_procs, ("decode", *MLA, "--num-blocks", "128", "--tp", "2"),
                                 ("prefill", *MLA, "--num-blocks", "64", "--prefill-chunk", "20", "--tp", "2"))
    async with aiohttp.ClientSession() as session:
        await check_prompts(session, build_model("tiny-mla", seed=0), prefill, decode)
    assert prefill.stop() == 0 and decode.stop() == 0
