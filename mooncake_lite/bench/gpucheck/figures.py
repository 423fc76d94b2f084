"""A stage's output as table rows, each beside its goal on an H200 (docs/gpu.md) where it has one.

Goals are judged only on CUDA; on a CPU (the dry run) every row is a figure without a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from mooncake_lite.bench.gpucheck.plan import BIG_MODEL, KitPlan
from mooncake_lite.bench.gpucheck.run import StageResult

GRAPH_STEP_GOAL_MS = 2.0        # the default model's batch-1 step with CUDA graphs
DECODE_ROOF_GOAL = 1.5          # llama3-8b batch-1 step / HBM-roof time of reading its weights
PREFILL_MFU_GOAL = 0.40         # llama3-8b 2,048-token prefill against the bf16 dense peak
COPY_SHARE_GOAL = 0.80          # block-sized pinned copies against one large copy
HIDDEN_GOAL = 0.80              # share of layer-wise transfer hidden behind compute
SERVED_GOAL = 1.5               # a prompt through the prefill's stage engine (KV dropped) / its plain forward


@dataclass(frozen=True)
class Row:
    stage: str
    figure: str
    measured: str
    goal: str = ""
    met: bool | None = None     # None: no goal here (or not judged off CUDA)

    def to_dict(self) -> dict:
        return asdict(self)


def _judge(plan: KitPlan, ok: bool | None) -> bool | None:
    return ok if plan.on_cuda else None


def _pct(x: float | None) -> str:
    return "unknown" if x is None else f"{100 * x:.1f}%"


def test_rows(plan: KitPlan, out: dict) -> list[Row]:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", out["text"])}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing ran"
    return [Row("tests", "GPU-marked and Triton equivalence tests", summary, "none failed",
                failed == 0 if plan.on_cuda else None)]


def model_rows(plan: KitPlan, out: dict) -> list[Row]:
    rows = []
    for name, m in out["models"].items():
        p, big = m["prefill"], name.startswith(BIG_MODEL)
        mfu = p.get("mfu")
        rows.append(Row("bench-model", f"{name}: prefill {p['tokens']} tokens",
                        f"{p['tokens_per_s_best']:.0f} tok/s, MFU {_pct(mfu)}",
                        f"MFU >= {PREFILL_MFU_GOAL:.0%}" if big else "",
                        _judge(plan, mfu is not None and mfu >= PREFILL_MFU_GOAL) if big else None))
        for batch, d in m["decode"].items():
            share = d.get("fraction_of_hbm") or d.get("fraction_of_copy_bandwidth")
            over = 1 / share if share else None
            roof = "HBM" if d.get("fraction_of_hbm") else "copy"
            judged = big and batch == "1"
            rows.append(Row("bench-model", f"{name}: decode step, batch {batch} (eager)",
                            f"{d['step_ms_best']:.2f} ms = {over:.2f}x the {roof}-roof time" if over else
                            f"{d['step_ms_best']:.2f} ms",
                            f"<= {DECODE_ROOF_GOAL}x HBM roof" if judged else "",
                            _judge(plan, over is not None and over <= DECODE_ROOF_GOAL) if judged else None))
    return rows


def graph_rows(plan: KitPlan, out: dict) -> list[Row]:
    rows = []
    for i, (name, m) in enumerate(out.items()):
        for batch, d in m["batches"].items():
            judged = i == 0 and batch == "1"
            roof = f", {d['graph_over_roof']:.2f}x HBM roof" if d.get("graph_over_roof") else ""
            rows.append(Row("decode-graphs", f"{name}: decode step, batch {batch}, "
                            + ("CUDA graph" if m["captured"] else "bucketed, not captured (CPU)"),
                            f"{d['graph_ms']:.2f} ms (eager {d['eager_ms']:.2f} ms, {d['speedup']:.2f}x){roof}",
                            f"<= {GRAPH_STEP_GOAL_MS} ms" if judged else "",
                            _judge(plan, d["graph_ms"] <= GRAPH_STEP_GOAL_MS) if judged else None))
    return rows


def copy_rows(plan: KitPlan, out: dict) -> list[Row]:
    kind = "pinned" if out["pinned"] else "plain (CPU)"
    return [Row("copies", f"{out['block_bytes'] / 2**20:.2f} MiB {kind} block copies, {way}",
                f"{_pct(out[way]['share'])} of one large copy ({out[way]['block_copies_gbps']:.1f} vs "
                f"{out[way]['one_copy_gbps']:.1f} GB/s)", f">= {COPY_SHARE_GOAL:.0%}",
                _judge(plan, out[way]["share"] >= COPY_SHARE_GOAL)) for way in ("h2d", "d2h")]


def pd_rows(plan: KitPlan, out: dict) -> list[Row]:
    rows = []
    for name, m in out["models"].items():
        o = m["overlap"]
        rows.append(Row("bench-pd", f"{name}: layer-wise transfer hidden behind compute ({m['prompt_len']} tokens)",
                        f"{_pct(o['hidden_share'])} (transfer {o['transfer_s'] * 1e3:.1f} ms, exposed "
                        f"{o['exposed_transfer_s'] * 1e3:.1f} ms)", f">= {HIDDEN_GOAL:.0%}",
                        _judge(plan, o["hidden_share"] >= HIDDEN_GOAL)))
        if "served_over_forward" in o:   # (bench pd before the forward was timed beside it: no row)
            x = o["served_over_forward"]
            rows.append(Row("bench-pd", f"{name}: prefill through the stage engine (KV dropped) / its forward",
                            f"{x:.2f}x ({o['compute_compute_only_s'] * 1e3:.1f} vs {o['forward_s'] * 1e3:.1f} ms)",
                            f"<= {SERVED_GOAL}x", _judge(plan, x <= SERVED_GOAL)))
    return rows


def up_rows(plan: KitPlan, out: dict) -> list[Row]:
    a, r, cache = out["answer"], out["replay"]["metrics"], out["replay"].get("cache", {})
    return [Row("up", "cluster start (1P+1D), to its banner", f"{out['start_s']:.1f} s"),
            Row("up", f"README question: {a['question']}", f"{a['answer']!r} ({a['seconds'] * 1e3:.0f} ms)"),
            Row("up", f"trace replay, {r['num_requests']} requests", f"{r['completed']} completed, "
                f"{r['num_rejected_429']} refused (429), {r['num_failed']} failed", "all completed",
                _judge(plan, r["completed"] == r["num_requests"])),
            Row("up", "replay TTFT median / p99", f"{r.get('median_ttft_ms', 0):.0f} / {r.get('p99_ttft_ms', 0):.0f} ms"),
            Row("up", "replay ITL median / p99", f"{r.get('median_itl_ms', 0):.1f} / {r.get('p99_itl_ms', 0):.1f} ms"),
            Row("up", "replay prompt tokens served from the store", _pct(cache.get("cached_token_hit_rate")))]


ROWS: dict[str, Callable[[KitPlan, dict], list[Row]]] = {
    "tests": test_rows, "bench-model": model_rows, "decode-graphs": graph_rows, "copies": copy_rows,
    "bench-pd": pd_rows, "up": up_rows}


def rows_of(plan: KitPlan, result: StageResult) -> list[Row]:
    """The stage's rows; a stage that did not finish, or whose output lacks a figure, says so."""
    if result.status != "ok" or result.output is None:
        return [Row(result.name, "stage", f"{result.status}: {result.note}"[:200], "ran",
                    False if result.status in ("failed", "timeout") else None)]
    try:
        return ROWS[result.name](plan, result.output)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return [Row(result.name, "stage", f"output not understood: {exc!r}", "ran", False)]
