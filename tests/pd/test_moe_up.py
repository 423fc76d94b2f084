"""Qwen3-MoE and DeepSeek-V3 (MLA) checkpoint directories served by ``mooncake up``: greedy chat
answers equal ``transformers``' on the same weights, and a second turn reuses the first turn's
KV (for DeepSeek, the cached latent rows) from the store and still matches."""

from __future__ import annotations

import time

import pytest

from tests.cluster.helpers import real_cluster
from tests.model.hf_fixtures import CHAT_TEMPLATE, hf_greedy, save_chat_tokenizer, save_deepseek_v3, save_qwen3_moe

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

VOCAB = 400
BLOCK = 8
CORPUS = ["Mooncake keeps the attention cache in a distributed pool.", "Experts are chosen per token.",
          "The latent is cached instead of keys and values.", "user assistant system"]
SAVERS = {"qwen3_moe": save_qwen3_moe, "deepseek_v3": save_deepseek_v3}


@pytest.fixture(scope="module", params=list(SAVERS))
def served(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    eos = save_chat_tokenizer(path, CORPUS, VOCAB)
    hf = SAVERS[request.param](path, seed=21, vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=eos)
    with real_cluster("--model", str(path), "--block-size", str(BLOCK), ready_timeout=200) as url:
        yield url, path, hf


def hf_prompt_ids(path, messages) -> list[int]:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    text = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def chat(client, messages, max_tokens):
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    body = resp.to_dict()
    return resp, body["prompt_token_ids"], body["choices"][0]["token_ids"]


def test_two_turns_equal_transformers_and_the_second_reuses_the_first(served):
    url, path, hf = served
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    turn1 = [{"role": "user", "content": " ".join(CORPUS * 3)}]
    resp1, prompt1, out1 = chat(client, turn1, 10)
    assert prompt1 == hf_prompt_ids(path, turn1) and len(prompt1) > 4 * BLOCK
    assert out1 == hf_greedy(hf, prompt1, 10)
    time.sleep(1.5)     # write-back is asynchronous; block events reach the conductor every 0.2 s
    turn2 = turn1 + [{"role": "assistant", "content": resp1.choices[0].message.content},
                     {"role": "user", "content": "Which experts are chosen?"}]
    resp2, prompt2, out2 = chat(client, turn2, 10)
    assert prompt2[:len(prompt1)] == prompt1
    cached = resp2.usage.prompt_tokens_details.cached_tokens
    assert cached >= (len(prompt1) // BLOCK) * BLOCK > 0, (cached, len(prompt1))
    assert out2 == hf_greedy(hf, prompt2, 10)
