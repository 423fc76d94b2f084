"""fp8 checkpoints (``quant_method: fp8``, e4m3 weights with ``weight_scale_inv``): written here
from a tiny random LLaMA, per block (with partial blocks) and per tensor, and loaded to the same
values and logits as a float checkpoint of those weights dequantized block by block in the test
(a dequantize-then-matmul reference); other quantizations and broken scales refused, named."""

from __future__ import annotations

import json

import pytest
import torch

from mooncake_lite.model.checkpoint_config import model_args
from mooncake_lite.model.errors import CheckpointError
from mooncake_lite.model.generate import full_recompute_logits
from mooncake_lite.model.loader import load_checkpoint
from tests.model.hf_fixtures import VOCAB, save_llama

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")
E4M3_MAX = 448.0
BLOCK = (16, 32)   # small blocks, so the tiny model's 48 x 100 weights have several, some partial


def blocks_of(rows: int, cols: int, block: tuple[int, int] | None):
    br, bc = block or (rows, cols)
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            yield i // br, j // bc, slice(i, i + br), slice(j, j + bc)


def quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv, the values it stands for: each block's fp8 times its scale)."""
    rows, cols = w.shape
    br, bc = block or (rows, cols)
    scales = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    ref = torch.empty(rows, cols)
    for bi, bj, r, c in blocks_of(rows, cols, block):
        scales[bi, bj] = w[r, c].abs().max() / E4M3_MAX
        q[r, c] = (w[r, c] / scales[bi, bj]).to(torch.float8_e4m3fn)
        ref[r, c] = q[r, c].float() * scales[bi, bj]
    return q, (scales if block else scales.reshape(())), ref


def write_fp8(src, dst, block, quantization: dict | None = None):
    """The checkpoint at ``src`` with every projection weight in e4m3 (as DeepSeek-V3's: not the
    embedding, norms or head) at ``dst``, and a float32 one of the dequantized values at
    ``dst``-ref."""
    tensors = safetensors_torch.load_file(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and "proj" in name:
            q, scale, values = quantize(t.float(), block)
            fp8[name], fp8[name + "_scale_inv"], ref[name] = q, scale, values
        else:
            fp8[name] = ref[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for out, weights, qcfg in ((dst, fp8, quantization or {"quant_method": "fp8", "fmt": "e4m3",
                                                           "activation_scheme": "dynamic",
                                                           **({"weight_block_size": list(block)} if block else {})}),
                               (dst.with_name(dst.name + "-ref"), ref, None)):
        out.mkdir()
        safetensors_torch.save_file(weights, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(cfg | ({"quantization_config": qcfg} if qcfg else {})))
    return dst, dst.with_name(dst.name + "-ref")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    save_llama(path, seed=3, num_layers=2)
    return path


@pytest.mark.parametrize("block", [BLOCK, None], ids=["128x128-style blocks", "per tensor"])
def test_fp8_weights_load_as_their_dequantized_values(tmp_path, hf_dir, block):
    fp8_dir, ref_dir = write_fp8(hf_dir, tmp_path / "fp8", block)
    ours, ref = load_checkpoint(str(fp8_dir)), load_checkpoint(str(ref_dir))
    layer, theirs = ours.layers["1"], ref.state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in ours.state_dict().items())   # every weight, bit for bit
    toks = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    got, want = full_recompute_logits(ours, toks, 8), full_recompute_logits(ref, toks, 8)
    # The same weights, not always the same last bits: the fp8 file's other tensors sit at offsets
    # a float32 file's do not, and a CPU's kernels may sum differently by alignment (AMD Zen 5:
    # 4.8e-7 of logits up to ~3), far below what fp8 itself moves (a weight by up to 0.1, below).
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-5)
    assert want.abs().max() > 1.0
    original = load_checkpoint(str(hf_dir))   # fp8 is close to the unquantized model, not equal
    assert 0 < (layer.feed_forward.w2.weight - original.layers["1"].feed_forward.w2.weight).abs().max() < 0.1
    assert load_checkpoint(str(fp8_dir), dtype=torch.bfloat16).layers["0"].attention.wo.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("quantization, field", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_other_quantizations_are_refused_naming_them(tmp_path, hf_dir, quantization, field):
    fp8_dir, _ = write_fp8(hf_dir, tmp_path / "q", BLOCK, quantization)
    for load in (model_args, load_checkpoint):
        with pytest.raises(CheckpointError, match=field) as err:
            load(str(fp8_dir))
        assert "quantization_config" in str(err.value)


def test_broken_scales_are_refused_naming_the_tensor(tmp_path, hf_dir):
    fp8_dir, _ = write_fp8(hf_dir, tmp_path / "bad", BLOCK)
    tensors = safetensors_torch.load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:, :1].contiguous()   # too few blocks
    safetensors_torch.save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.weight.*do not tile"):
        load_checkpoint(str(fp8_dir))
    del tensors[name + "_scale_inv"]
    safetensors_torch.save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.weight.*no 'model.layers.0.mlp.down_proj.weight_scale_inv'"):
        load_checkpoint(str(fp8_dir))
