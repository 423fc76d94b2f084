"""A chat request's ``chat_template_kwargs`` (vLLM's and SGLang's extension): variables for the
model's own chat template, such as Qwen3's ``enable_thinking``."""

from __future__ import annotations

import pytest

from mooncake_lite.conductor.api.errors import ApiError
from mooncake_lite.conductor.api.params import parse_request
from mooncake_lite.model.chat import ChatTemplate
from mooncake_lite.model.tokenizer import ByteTokenizer

# A template of our own that reads a switch the way thinking models' templates do.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}")


class TemplatedTokenizer(ByteTokenizer):
    chat_template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})


TOK = TemplatedTokenizer(320)
MESSAGES = [{"role": "user", "content": "hi"}]


def rendered(**extra) -> str:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, **extra}
    ids = parse_request(body, "chat", served=("m",), tokenizer=TOK, vocab_size=320, max_context=512).prompt_ids
    return TOK.decode(list(ids))


def test_template_kwargs_reach_the_template():
    assert rendered() == "<s>[user]hi[assistant]"
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == "<s>[user]hi[assistant]<think></think>"
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == rendered()
    assert rendered(chat_template_kwargs={}) == rendered(chat_template_kwargs=None) == rendered()


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"bos_token": "X"},
                                    {"eos_token": "X"},             # a special token this checkpoint lacks
                                    {"namespace": 1}, {"raise_exception": 1}, {"range": 1},   # its functions
                                    {"not a name": 1}, ["enable_thinking"], "enable_thinking=false"])
def test_what_the_server_sets_or_not_an_object_is_refused(kwargs):
    with pytest.raises(ApiError) as err:
        rendered(chat_template_kwargs=kwargs)
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs"


def test_a_name_render_itself_takes_or_a_value_the_template_fails_on_is_not_a_500():
    assert rendered(chat_template_kwargs={"self": 1}) == rendered()     # passed as data, never as an argument
    failing = ChatTemplate("{{ messages | length + enable_thinking }}", {})
    tok = type("T", (ByteTokenizer,), {"chat_template": failing})(320)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": "x"}}
    with pytest.raises(ApiError) as err:                                 # int + str inside the template
        parse_request(body, "chat", served=("m",), tokenizer=tok, vocab_size=320, max_context=512)
    assert err.value.status == 400 and "chat template failed" in err.value.message
