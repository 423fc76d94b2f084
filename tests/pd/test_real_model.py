"""The default real model through ``mooncake up`` at its default settings (store, conductor,
prefill, decode as processes): greedy chat completions equal ``transformers``' ``generate`` on
the same GGUF token for token, and a second chat turn reuses the first turn's KV from the store."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.real_model import SMOLLM, hf_chat_ids, hf_greedy, hf_greedy_batch, hf_tokenizer, needs_smollm

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), needs_smollm]

MAX_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning Python.",
    "Why is the sky blue? Answer in one sentence.",
    "List the planets closest to the sun.",
    "Write a Python function that reverses a string.",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one line.",
    "Who wrote 'Pride and Prejudice'?",
    "Explain what a linked list is.",
    "Suggest a name for a black cat.",
    "What's the boiling point of water in Fahrenheit?",
    "Écris une phrase en français sur la lune.",
    "What is the square root of 144?",
    "Describe a rainbow to a child.",
    "Give an example of a SQL SELECT statement.",
    "How many days are in a leap year? 🗓️",
]
# A first turn of ordinary chat length: several 64-token blocks of context before the question.
DOCUMENT = (
    "Mooncake is the serving platform of Kimi, an LLM chatbot. It separates the prefill and decode "
    "stages into different clusters and keeps a distributed cache of attention keys and values in the "
    "spare DRAM and SSD of the GPU nodes. A global scheduler, the conductor, places each request on a "
    "prefill instance by how much of its prompt is already cached there, how long that instance's queue "
    "is, and how long it would take to fetch the rest of the cached prefix from another node. When the "
    "cluster is overloaded, requests that could not meet their latency objectives are rejected early, "
    "before any compute is spent on them, and the rejection is predicted from the load the decode "
    "instances will have when the prefill finishes, not from the load they have now. ") * 2


@pytest.fixture(scope="module")
def api(smollm_api):
    """``mooncake up`` exactly as a user runs it (default model, block size and admission), shared
    with the session's other default-model tests (tests/conftest.py)."""
    return smollm_api


def _chat(client, messages: list[dict], max_tokens: int = MAX_TOKENS):
    resp = client.chat.completions.create(model=SMOLLM, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True})
    body = resp.to_dict()
    return resp, body["prompt_token_ids"], body["choices"][0]["token_ids"]


def _expect(prompt_ids: list[int], max_tokens: int) -> list[int]:
    return hf_greedy(prompt_ids, max_tokens)


def test_models_endpoint_names_the_real_model(api):
    client = openai.OpenAI(base_url=api, api_key="none", max_retries=0, timeout=120)
    models = client.models.list().data
    assert [m.id for m in models] == [SMOLLM]


def test_greedy_chat_equals_transformers_token_for_token(api):
    # a burst may be refused in part (429 + Retry-After) on a slow or loaded box: retried, as the
    # official client does by default (tests/pd/test_structured_up.client)
    client = openai.OpenAI(base_url=api, api_key="none", max_retries=8, timeout=300)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:     # a few at once: decode batches them
        answers = list(pool.map(lambda m: _chat(client, m), conversations))
    eos = hf_tokenizer().convert_tokens_to_ids("<|im_end|>")
    batched = hf_greedy_batch([prompt_ids for _, prompt_ids, _ in answers], MAX_TOKENS)
    mismatches = []
    for messages, (resp, prompt_ids, token_ids), expected in zip(conversations, answers, batched):
        assert prompt_ids == hf_chat_ids(messages)          # the checkpoint's own chat template
        if token_ids != expected:    # padding's last bits, or ours: the prompt alone decides
            expected = _expect(prompt_ids, MAX_TOKENS)
        if token_ids != expected:
            mismatches.append((messages[0]["content"], token_ids, expected))
        assert resp.choices[0].finish_reason == ("stop" if expected[-1] == eos else "length")
        assert resp.usage.prompt_tokens == len(prompt_ids) and resp.usage.completion_tokens == len(token_ids)
        assert "<|im_end|>" not in resp.choices[0].message.content
    assert not mismatches, mismatches
    france = answers[0][0].choices[0].message.content
    assert "Paris" in france, france


def test_second_turn_reuses_the_first_turns_kv_and_still_matches(api):
    client = openai.OpenAI(base_url=api, api_key="none", max_retries=0, timeout=300)
    turn1 = [{"role": "system", "content": "You answer questions about the text the user gives."},
             {"role": "user", "content": DOCUMENT + "\n\nWhat does the conductor do?"}]
    resp1, prompt1, out1 = _chat(client, turn1)
    assert len(prompt1) > 200 and out1 == _expect(prompt1, MAX_TOKENS)
    time.sleep(1.5)     # write-back is asynchronous; block events reach the conductor every 0.2 s
    turn2 = turn1 + [{"role": "assistant", "content": resp1.choices[0].message.content},
                     {"role": "user", "content": "And what happens when the cluster is overloaded?"}]
    resp2, prompt2, out2 = _chat(client, turn2)
    assert prompt2[:len(prompt1)] == prompt1
    cached = resp2.usage.prompt_tokens_details.cached_tokens
    assert cached >= (len(prompt1) // 64) * 64 > 0, (cached, len(prompt1))
    assert out2 == _expect(prompt2, MAX_TOKENS)
