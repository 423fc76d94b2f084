"""A Qwen3-shaped checkpoint directory (128-wide heads in miniature: heads wider than hidden /
heads, q/k norm, tied head) with its own tokenizer and chat template, served by ``mooncake up`` as
a user would: every role reads the directory, KV crosses processes and the store at the head's
width, and greedy chat answers equal ``transformers``' on the same weights and the same rendered
prompt. The template's ``enable_thinking`` switch comes from the request's ``chat_template_kwargs``."""

from __future__ import annotations


import pytest

from tests.cluster.helpers import real_cluster
from tests.model.hf_fixtures import hf_greedy, save_chat_tokenizer, save_qwen3

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VOCAB = 400
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# A ChatML-style template of our own with a thinking switch, as thinking models' templates have.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
CORPUS = ["What is the capital of France?", "The capital of France is Paris.", "Name three primary colors.",
          "user assistant system", "Let me think about it step by step."]


def write_checkpoint(path) -> object:
    eos = save_chat_tokenizer(path, CORPUS, VOCAB, SPECIALS, TEMPLATE)
    return save_qwen3(path, seed=11, vocab_size=VOCAB, max_position_embeddings=512, eos_token_id=eos)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-up")
    hf = write_checkpoint(path)
    with real_cluster("--model", str(path), "--block-size", "8", ready_timeout=200) as url:
        yield url, path, hf


def hf_prompt_ids(path, messages, **kwargs) -> list[int]:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                   **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("thinking", [None, False])
def test_chat_answers_equal_transformers_on_the_same_weights(served, thinking):
    url, path, hf = served
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? " * 3}]
    extra = {"return_token_ids": True, "ignore_eos": True}
    if thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": thinking}
    body = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                          extra_body=extra).to_dict()
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    want_prompt = hf_prompt_ids(path, messages, **kwargs)
    assert body["prompt_token_ids"] == want_prompt                 # the checkpoint's template, rendered alike
    assert (hf.config.head_dim, hf.config.hidden_size // hf.config.num_attention_heads) == (16, 8)
    assert body["choices"][0]["token_ids"] == hf_greedy(hf, want_prompt, 12)
