"""Chat templates of our own with a tools section, one per tool-call format, written the way
Qwen's (Hermes ``<tool_call>``) and Llama 3.1's (JSON ``parameters``) are: the tools listed in a
system turn, an assistant's calls in the format, tool results in their own turn."""

HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nRespond with a JSON for a function call "
    "as {\"name\": function name, \"parameters\": its arguments}.\n"
    "{%- for t in tools %}\n{{ t | tojson(indent=4) }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% if not loop.last %}; {% endif %}{%- endfor %}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 12}},
                                     "required": ["q"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
