"""Llama 3.1-style rope scaling (``rope_type: "llama3"``) against transformers itself."""

import json

import pytest
import torch

from mooncake_lite.model.args import ModelArgs, RopeScaling, with_overrides
from mooncake_lite.model.generate import full_recompute_logits, generate
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.llama import llama3_inv_freq
from mooncake_lite.model.loader import CheckpointError, load_checkpoint, read_args
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.sampling import SamplingParams
from tests.model.hf_fixtures import hf_greedy, hf_logits, save_llama
from tests.model.test_hf_checkpoint import ATOL, BS, RTOL, prompt

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# head_dim 16 with theta 5e5 puts one wavelength below 64/4 (kept), one between 64/4 and 64/1
# (blended) and six above (divided by 8), so every branch of the rule is compared with HF.
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0)
SEQ = 150  # well past original_max_position_embeddings


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama31")
    return path, save_llama(path, seed=7, rope_scaling=dict(LLAMA3), **SHAPE)


def test_read_args_keeps_rope_scaling(llama31):
    args = read_args(str(llama31[0]))
    assert args.rope_theta == 500000.0 and args.head_dim == 16
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    hash(args)  # still a frozen, hashable value


def test_all_three_bands_are_exercised():
    inv = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    got = llama3_inv_freq(inv, RopeScaling(8.0, 1.0, 4.0, 64))
    assert got[0] == inv[0]
    assert inv[1] / 8 < got[1] < inv[1]
    torch.testing.assert_close(got[2:], inv[2:] / 8, atol=0, rtol=1e-7)


def test_logits_match_hf(llama31):
    path, hf = llama31
    ours = load_checkpoint(str(path))
    toks = prompt(SEQ, 31)
    ref = hf_logits(hf, toks)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(full_recompute_logits(ours, toks, BS), ref, atol=ATOL, rtol=RTOL)
    # The check above must be able to fail: plain RoPE on the same weights is far off.
    ours.args = with_overrides(ours.args, rope_scaling=None)
    assert (full_recompute_logits(ours, toks, BS) - ref).abs().max() > 100 * ATOL


def test_paged_greedy_matches_hf_generate(llama31):
    path, hf = llama31
    toks = prompt(SEQ, 32)
    runner = ModelRunner(load_checkpoint(str(path)), num_blocks=blocks_needed(SEQ + 10, BS), block_size=BS)
    assert generate(runner, toks, SamplingParams(max_tokens=10), 64) == hf_greedy(hf, toks, 10)


def rewrite_rope(path, rope):
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg |= {"rope_scaling": rope, "rope_theta": 500000.0}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "longrope"])
def test_other_rope_types_are_refused(llama31, tmp_path, rope_type):
    (tmp_path / "config.json").write_text((llama31[0] / "config.json").read_text())
    rewrite_rope(tmp_path, LLAMA3 | {"rope_type": rope_type})
    with pytest.raises(CheckpointError, match=f"rope_scaling.rope_type '{rope_type}' "
                                              r"\(supported: default, llama3\)"):
        read_args(str(tmp_path))


@pytest.mark.parametrize("rope, message", [
    ({k: v for k, v in LLAMA3.items() if k != "factor"}, "rope_scaling.factor is missing"),
    (LLAMA3 | {"low_freq_factor": "1"}, "rope_scaling.low_freq_factor '1' is not a number"),
    (LLAMA3 | {"high_freq_factor": 1.0}, "high_freq_factor 1.0 must exceed low_freq_factor"),
])
def test_malformed_llama3_is_refused_naming_the_field(llama31, tmp_path, rope, message):
    (tmp_path / "config.json").write_text((llama31[0] / "config.json").read_text())
    rewrite_rope(tmp_path, rope)
    with pytest.raises(CheckpointError, match=message):
        read_args(str(tmp_path))


def test_older_rope_scaling_key_and_legacy_type_spelling():
    base = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 8,
            "vocab_size": 10}
    new = ModelArgs.from_hf_config(base | {"rope_parameters": LLAMA3 | {"rope_theta": 5e5}})
    old = ModelArgs.from_hf_config(base | {"rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}})
    assert new == old and new.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64) and new.rope_theta == 5e5
    assert ModelArgs.from_hf_config(base | {"rope_parameters": {"rope_type": "default"}}).rope_scaling is None
