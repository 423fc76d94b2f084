"""``mooncake bench model``: its FLOP accounting is right and it prints one JSON object."""

import dataclasses
import functools
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mooncake_kernels.quant_build import library
from mooncake_lite.bench.model import cli as bench_model
from mooncake_lite.bench.model import roofs, sources
from mooncake_lite.bench.model.cli import main, parse_args
from mooncake_lite.bench.model.flops import decode_flops, prefill_flops, weight_bytes
from mooncake_lite.bench.model.sources import describe_model
from mooncake_lite.model.args import ModelArgs
from mooncake_lite.model.linear import PACK_GAIN
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import ModelNotInstalledError
from mooncake_lite.model.weights import build_model
from tests.model import tp_ranks  # noqa: F401  (its forkserver preload)
from tests.real_model import SMOLLM, needs_smollm, smollm_path

BS = 8


@pytest.fixture(scope="module", params=["tiny", "wide-heads"])
def runner(request):
    """The tiny preset, and the same with Qwen3's heads: wider than dim / heads, q/k normalised."""
    if request.param == "tiny":
        return ModelRunner(build_model("tiny"), num_blocks=32, block_size=BS)
    tiny = ModelArgs.from_name("tiny")
    args = dataclasses.replace(tiny, head_size=2 * tiny.head_dim, qk_norm=True)
    return ModelRunner(Transformer(args).fuse_().eval(), num_blocks=32, block_size=BS)


def matmul_flops_counted(fn) -> int:
    """FLOPs of the matrix multiplies torch actually ran (this torch's counter does not see the
    CPU SDPA kernel, so attention is checked against its closed form separately)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    counts = fc.get_flop_counts()["Global"]
    return sum(v for k, v in counts.items() if str(k).split(".")[-1] in ("mm", "addmm", "bmm", "matmul"))


def attention_flops(a, num_queries, keys_seen):
    return 4 * a.num_layers * a.num_heads * a.head_dim * num_queries * keys_seen  # QK^T and PV, 2 FLOPs per MAC


def test_decode_flops_match_torch_flop_counter(runner):
    batch, width = 3, 4
    tables = [list(range(i * width, (i + 1) * width)) for i in range(batch)]
    pos = width * BS - 1
    got = matmul_flops_counted(lambda: runner.decode([5] * batch, tables, [pos] * batch))
    expected = decode_flops(runner.args, batch, context_len=pos + 1)
    assert got > 0 and got + attention_flops(runner.args, batch, pos + 1) == expected


def test_prefill_flops_match_torch_flop_counter(runner):
    n, a = 3 * BS, runner.args
    got = matmul_flops_counted(lambda: runner.prefill(list(range(n)), list(range(3)), 0))
    causal_pairs = n * (n + 1) / 2  # query i sees keys 0..i
    assert got > 0 and got + attention_flops(a, 1, causal_pairs) == prefill_flops(a, n)


def test_weight_bytes(runner):
    model = runner.model
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_emb" not in n)
    assert weight_bytes(runner.args, torch.float32) == 4 * matmul_params
    assert weight_bytes(runner.args, torch.bfloat16) == 2 * matmul_params


def test_json_output(capsys):
    rc = main(["--models", "tiny", "--prompt-len", "16", "--context-len", "16", "--batch-sizes", "1,2",
               "--decode-steps", "2", "--repeats", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["machine"]["matmul_gflops"] > 0 and res["machine"]["copy_gbps"] > 0
    tiny = res["models"]["tiny"]
    assert tiny["prefill"]["tokens"] == 16 and tiny["prefill"]["tokens_per_s"] > 0
    assert set(tiny["decode"]) == {"1", "2"}
    assert all(0 < d["fraction_of_matmul_peak"] and d["step_ms"] > 0 for d in tiny["decode"].values())
    # Decode as a decode instance runs it (packed weights where oneDNN is), its matmuls timed alone
    # beside each step, and the batch-2 step as a multiple of the batch-1 step.
    assert tiny["decode_packed"] == torch.backends.mkldnn.is_available()
    two = tiny["decode"]["2"]
    assert 0 < two["matmuls_ms_best"] and 0 < two["matmuls_fraction_of_matmul_peak"]
    assert two["outside_matmuls_share"] == pytest.approx(
        max(two["step_ms_best"] - two["matmuls_ms_best"], 0) / two["step_ms_best"])
    assert two["step_over_batch1"] == pytest.approx(two["step_ms"] / tiny["decode"]["1"]["step_ms"])
    assert "step_over_batch1" not in tiny["decode"]["1"]
    # prefill as a prefill instance runs it: packed where that measured >= PACK_GAIN faster here
    pre = tiny["prefill"]
    if torch.backends.mkldnn.is_available():
        assert pre["packing_speedup"] > 0 and pre["packed"] == (pre["packing_speedup"] >= PACK_GAIN)
    assert tiny["source"]["kind"] == "preset" and tiny["source"]["weights"].startswith("dummy")
    assert tiny["source"]["load_s"] >= tiny["source"]["build_s"] > 0 and res["notes"] == []


def test_the_matmul_roof_is_the_faster_of_the_two_kernels(monkeypatch):
    """The model runs on MKL's sgemm and on oneDNN's packed kernel; a roof of one alone was passed
    by the other (oneDNN at twice MKL's rate on an AVX-512 EPYC)."""
    ran = []

    def best(fn, device, repeats, warmup=0):
        ran.append(fn)
        return 1.0 if len(ran) == 1 else 0.5      # the second kernel timed twice as fast
    monkeypatch.setattr(roofs, "best_seconds", best)
    gflops = roofs.matmul_gflops(n=64)
    expected = 2 * 64**3 / 1e9
    assert gflops == pytest.approx(expected * (2 if torch.backends.mkldnn.is_available() else 1))
    assert len(ran) == (2 if torch.backends.mkldnn.is_available() else 1)


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--batch-sizes", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["--models", "no-such-preset", "--repeats", "1"]) == 2
    assert "unknown model preset" in capsys.readouterr().err


def test_real_model_in_the_default_list_and_accepted_by_name():
    args = parse_args([])
    assert args.models == ["tiny", "small", SMOLLM] and args.default_models
    args = parse_args(["--models", f"{SMOLLM},tiny,/models/x.gguf"])
    assert args.models == [SMOLLM, "tiny", "/models/x.gguf"] and not args.default_models


@needs_smollm
def test_describe_a_real_checkpoint():
    src = describe_model(SMOLLM)
    assert src["kind"] == "gguf" and src["weights"] == "checkpoint" and src["path"].endswith(".gguf")
    assert "SmolLM2" in src["description"]


def test_a_missing_real_model_is_skipped_from_the_defaults_only(monkeypatch):
    real = sources.model_args

    def fake(name):
        if name == SMOLLM:
            raise ModelNotInstalledError("not installed: pip install ...")
        return real(name)
    monkeypatch.setattr(sources, "model_args", fake)
    keep, notes = sources.usable_models(["tiny", SMOLLM], drop_missing=True)
    assert list(keep) == ["tiny"] and SMOLLM in notes[0] and "pip install" in notes[0]
    with pytest.raises(ModelNotInstalledError):
        sources.usable_models(["tiny", SMOLLM], drop_missing=False)


def test_dtypes_in_one_run_and_the_decode_profile(capsys, monkeypatch):
    for roof in ("matmul_gflops", "copy_gbps", "read_gbps"):    # measured by test_json_output already
        monkeypatch.setattr(bench_model, roof, lambda **_: 10.0)
    rc = main(["--models", "tiny", "--prompt-len", "8", "--context-len", "8", "--batch-sizes", "1",
               "--decode-steps", "1", "--repeats", "1", "--dtype", "float32,bfloat16", "--profile", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["models"]) == {"tiny float32", "tiny bfloat16"} and res["machine"]["read_gbps"] > 0
    f32, bf16 = res["models"]["tiny float32"], res["models"]["tiny bfloat16"]
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # bandwidth x step time = the weight bytes in that dtype (bfloat16 reads half of float32)
    for r, size in ((f32, 4), (bf16, 2)):
        d = r["decode"]["1"]
        assert abs(d["weight_gbps_best"] * d["step_ms_best"] / 1e3 * 1e9
                   - weight_bytes(sources.model_args("tiny"), getattr(torch, r["dtype"]))) < 1e3
        # the KV attended: every cached token's K and V in every layer, in the cache's dtype
        assert d["kv_bytes_read"] == res["settings"]["context_len"] * sources.model_args("tiny").kv_bytes_per_token(
            r["dtype"])
        assert d["fraction_of_copy_bandwidth_with_kv"] > d["fraction_of_copy_bandwidth"]
        kinds = r["decode_profile"]["ms_per_step"]
        assert set(kinds) >= {"matmul", "attention", "kv gather", "kv write", "other ops", "outside ops"}
        assert kinds["matmul"] > 0 and kinds["attention"] > 0 and kinds["kv write"] > 0


def test_bad_dtype(capsys):
    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--dtype", "float64"])
    assert "--dtype takes" in capsys.readouterr().err


def test_tp_compares_ranks_with_tp1_in_one_run(capsys, monkeypatch):
    """``--tp 2``: TP=1 and TP=2 figures side by side; the collectives' share is a fraction of
    the step that TP=1 (no collectives) does not have; a model 2 does not divide is skipped."""
    # its ranks fork from the tests' forkserver (tests/model/tp_ranks.py), not spawned afresh
    from mooncake_lite.bench.model import tp
    monkeypatch.setattr(tp.mp, "spawn", functools.partial(tp.mp.start_processes, start_method="forkserver"))
    models = "tiny" + (f",{SMOLLM}" if smollm_path() else "")   # 9 heads: 2 does not divide them
    rc = main(["--models", models, "--tp", "2", "--prompt-len", "16", "--context-len", "16",
               "--decode-steps", "2", "--repeats", "1", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    tiny = res["tp_models"]["tiny"]
    for kind in ("prefill", "decode"):
        assert tiny["tp1"][kind]["collective_share"] == 0
        assert 0 < tiny["tp2"][kind]["collective_share"] < 1
        assert tiny["speedup"][kind] == pytest.approx(tiny["tp1"][kind]["ms"] / tiny["tp2"][kind]["ms"])
    assert len(tiny["ranks"]) == 2 and tiny["bare_all_reduce_ms"]["decode_row"] > 0
    if smollm_path():
        assert SMOLLM not in res["tp_models"]
        assert any(n.startswith(f"skipped {SMOLLM}: tensor-parallel degree 2 does not divide") for n in res["notes"])


def test_tp_refuses_a_degree_below_two(capsys):
    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--tp", "1"])
    assert "--tp must be at least 2" in capsys.readouterr().err


def test_weights_modes_and_the_llamacpp_peer_in_the_report(capsys, monkeypatch, tmp_path):
    """Both weight modes of a GGUF model side by side, bytes per weight, and the peer beside our
    per-token times; a peer that cannot run is reported, not fatal."""
    import sys
    from mooncake_lite.bench.model.llamacpp_peer import measure_peer
    with pytest.raises(SystemExit):
        main(["--weights", "int3"])
    assert "--weights takes quantized, dequantize" in capsys.readouterr().err
    assert parse_args([]).weights == ["quantized", "dequantize"]
    missing = measure_peer(sys.executable, "x.gguf", 1, 4, 2)   # this Python has no llama_cpp
    assert "llama_cpp" in missing["error"]
    res = {"peers": {"m": {"version": "0.3", "threads": 1, "context_len": 8, "token_ms": 20.0, "token_ms_best": 18.0},
                     "n": missing},
           "models": {"m quantized": {"decode": {"1": {"step_ms": 10.0}, "16": {"step_ms": 80.0}}}}}
    text = "\n".join(bench_model._peer_lines(res))
    assert "batch-1 decode 20.00 ms a token" in text and "batch   1:   10.00 ms a token =  2.00x" in text
    assert "batch  16:    5.00 ms a token =  4.00x" in text and "llama.cpp on n: did not run" in text


@needs_smollm
@pytest.mark.skipif(library() is None, reason="no C compiler: nothing stays compact")
def test_held_weight_bytes_are_the_compact_blocks():
    from mooncake_lite.bench.model.flops import held_weight_bytes
    from mooncake_lite.model.quantized import QuantizedWeight
    model = build_model(SMOLLM)
    parts = {id(p): p for b in model.layers.values() for p in (*b.attention.packs.values(),
                                                                 *b.feed_forward.packs.values())}
    parts[id(model.output_pack)] = model.output_pack
    assert all(isinstance(p, QuantizedWeight) for p in parts.values())
    assert held_weight_bytes(model) == sum(p.nbytes for p in parts.values())
    assert held_weight_bytes(build_model("tiny")) == weight_bytes(ModelArgs.from_name("tiny"), torch.float32)


def test_peer_rounds_alternate_ours_and_the_peers_and_take_each_rounds_ratio(monkeypatch):
    """``--peer-rounds``: our steps, then the peer, round after round; the ratio per round and its
    median; a peer that cannot run ends the rounds with its error (tiny stands in for a GGUF)."""
    from tqdm import tqdm

    from mooncake_lite.bench.model import peer_rounds
    calls = []

    def peer(python, path, threads, context_len, steps):
        calls.append(("peer", context_len))
        return {"token_ms": 10.0 * len(calls)}
    real_decode = peer_rounds.bench_decode

    def ours(*args):
        calls.append(("ours", args[2]))
        return real_decode(*args)
    monkeypatch.setattr(peer_rounds, "measure_peer", peer)
    monkeypatch.setattr(peer_rounds, "bench_decode", ours)
    with tqdm(disable=True) as bar:
        r = peer_rounds.alternate_with_peer("tiny", "python", rounds=3, context_len=8, steps=2, bar=bar)
    assert [c[0] for c in calls] == ["ours", "peer"] * 3 and {c[1] for c in calls} == {8}
    assert len(r["ratios"]) == 3 and r["ratios"][2] == r["peer_ms"][2] / r["ours_ms"][2]
    assert r["ratio_median"] == sorted(r["ratios"])[1]
    text = "\n".join(peer_rounds.render_rounds("tiny", r))
    assert "alternating 3 rounds" in text and f"median {r['ratio_median']:.2f}x" in text
    monkeypatch.setattr(peer_rounds, "measure_peer", lambda *a: {"error": "no llama_cpp"})
    with tqdm(disable=True) as bar:
        failed = peer_rounds.alternate_with_peer("tiny", "python", rounds=3, context_len=8, steps=2, bar=bar)
    assert failed == {"error": "no llama_cpp"} and "did not run" in peer_rounds.render_rounds("tiny", failed)[0]
