"""A tool-calling loop through ``mooncake up --conductor-args "--tool-call-parser llama3_json"``
on a small checkpoint directory whose chat template (written here, Llama 3.1's way) renders
tools, calls and results: the prompt equals ``transformers``' ``apply_chat_template(...,
tools=...)`` token for token, and ``required`` yields a valid call in Llama 3's JSON format
from random weights (the grammar alone makes it valid); the call goes back as a ``tool``
message and the model answers."""

from __future__ import annotations

import json

import pytest

from tests.cluster.helpers import real_cluster
from tests.conductor.tool_templates import LLAMA3, TOOLS
from tests.model.hf_fixtures import save_qwen3

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

VOCAB = 400
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', "system user assistant ipython",
          "What is the weather in Paris?", "It is 21 C and sunny."]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = tmp_path_factory.mktemp("llama3-tools")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA3, "eos_token": "<|eot_id|>",
                                                            "bos_token": "<|begin_of_text|>"}))
    save_qwen3(path, seed=5, vocab_size=VOCAB, max_position_embeddings=2048, eos_token_id=tok.token_to_id("<|eot_id|>"))
    with real_cluster("--model", str(path), "--block-size", "16", "--conductor-args",
                      "--tool-call-parser llama3_json", ready_timeout=200) as url:
        yield url, path


def hf_prompt_ids(path, messages) -> list[int]:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                               bos_token="<|begin_of_text|>")
    text = tok.apply_chat_template(messages, tools=TOOLS, chat_template=LLAMA3, add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_tool_loop_in_llama3_json(served):
    url, path = served
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=120, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert first.to_dict()["prompt_token_ids"] == hf_prompt_ids(path, messages)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    final = c.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                      max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    hf_messages = [*messages[:1], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}]},
        messages[2]]
    assert final.to_dict()["prompt_token_ids"] == hf_prompt_ids(path, hf_messages)   # the call, rendered back
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
