"""``mooncake bench fidelity``: one trace slice, replayed live and simulated, side by side.

    mooncake bench fidelity --ttft-slo 45 --tbt-slo 1.33   # smollm2-135m, 1P+1D, 30 requests at 0.03x
    mooncake bench fidelity --conductor http://127.0.0.1:8000 --block-tokens 64   # a running cluster

1. Starts ``mooncake up`` (``--model``, ``--prefill``/``--decode``, ``--block-size`` = the trace
   block's tokens, so one trace block is one KV block) unless ``--conductor`` names a running one.
2. Replays the first ``-n`` requests of ``--trace`` through ``bench replay``'s own pieces
   (lengths scaled ``--block-tokens``/512, outputs scaled by ``--output-scale`` and capped at
   ``--max-output-tokens``, ``max_tokens`` = the output, ``ignore_eos``), at ``--speed``.
3. Exports the cluster's own cost models as ``mooncake sim export-costs`` does (in-process; the
   models as refined by the replay's own chunks and steps).
4. Simulates the same slice — the prompts' lengths as the server counted them, the same outputs,
   arrivals, instance counts, block size and admission — with that cost model.
5. Prints TTFT and TBT (the paper's: mean of each request's slowest 10% of gaps) mean/p50/p90,
   rejections (and whether the *same* requests were rejected), prefix-hit tokens, each with the
   simulator's relative error, plus the measured modelling gaps (``gaps``), the export's split of
   the decode's gaps beside a prefill forward from those without (``cost_model.colocation``),
   and the same slice simulated without each one-box effect the profile models (``ablations``);
   writes a CDF plot, and the instances' step and forward timelines (``timelines.json``). The
   simulated tokens reach the client with the delivery jitter measured live (``delivery.py``).

``--runs K`` does all of it K times, each on a fresh cluster (``OUTPUT_DIR/run-I``), and adds each
figure's median and range over the runs and the admission outcomes pooled (``runs.py``).

SLOs: the live conductor's default SLOs are relative (TTFT ≤ 10× the prompt's prefill alone, TBT ≤
5× one step alone, by the chosen instance's own profile), and so are the simulated conductor's and
decodes' (the same factors, each request by its own limit); the report shows their median over
the slice for reading. ``--ttft-slo``/``--tbt-slo`` make that one absolute on both sides.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import orjson

from mooncake_lite.bench import options
from mooncake_lite.bench.fidelity.delivery import delivery_jitter
from mooncake_lite.bench.fidelity.drift import machine_drift
from mooncake_lite.bench.fidelity.gaps import measured_gaps
from mooncake_lite.bench.fidelity.live import LEARN_LEAD_S, live_side, replay_live, start_cluster
from mooncake_lite.bench.replay.metrics import token_gaps
from mooncake_lite.bench.fidelity.report import cdf_plot, compare, report_text
from mooncake_lite.bench.fidelity.runs import repeated
from mooncake_lite.bench.fidelity.sim import (ablations, converted_slos, live_overtakes, live_profile, rejected_by,
                                            sim_side, sim_trace, simulate, simulated_predictions)
from mooncake_lite.bench.options import Options, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.common.units import parse_duration
from mooncake_lite.model.source import DEFAULT_MODEL
from mooncake_lite.scheduler.arrivals import DEFAULT_WINDOW_S

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"


FLAGS = (
    flag("--trace", default=DEFAULT_TRACE),
    # 30 requests at 0.03x: about 63% of one prefill instance on a 2-core box shared with other work
    flag("-n", "--num-requests", type=int, default=30, help="the first N requests of the trace"),
    flag("--speed", type=float, default=0.03, help="replay speed (0.03: 3%% of the recorded rate)"),
    flag("--arrival-spread", type=parse_duration, default=0.0, metavar="DURATION",
         help="as bench replay's: each request at a random point of its rounded timestamp's interval"),
    flag("--burst-window", type=parse_duration, default=DEFAULT_WINDOW_S, metavar="DURATION",
         help="the conductor's --burst-window, on both sides (0: each request placed as it comes)"),
    flag("--block-tokens", type=int, default=16,
                   help="tokens per 512-token trace block, and the cluster's KV block size"),
    flag("--output-scale", type=float, default=1.0, help="output length scale"),
    flag("--max-output-tokens", type=int, default=32, help="output cap"),
    flag("--conductor", default=None, help="a running cluster's conductor URL (default: start one)"),
    flag("--token", default=os.environ.get("MOONCAKE_CLUSTER_TOKEN"), help="its cluster token"),
    flag("--model", default=DEFAULT_MODEL, help="model of the cluster this command starts"),
    flag("--prefill", type=int, default=1),
    flag("--decode", type=int, default=1),
    flag("--admission", default="predictive", help="the conductor's admission (its default)"),
    flag("--prefill-args", default="", help="extra flags for the prefills this command starts, e.g. "
                                             "'--queue-order fifo' (mooncake up --prefill-args)"),
    flag("--ttft-slo", type=float, default=None, help="absolute TTFT SLO, seconds, on both sides"),
    flag("--tbt-slo", type=float, default=None, help="absolute TBT SLO, seconds, on both sides"),
    flag("--ttft-slo-factor", type=float, default=10.0, help="the conductor's relative TTFT SLO"),
    flag("--tbt-slo-factor", type=float, default=5.0, help="the conductor's relative TBT SLO"),
    flag("--ttft-admit-margin", type=float, default=0.0,
         help="the conductor's margin over the TTFT SLO before it refuses (its default: 0), on both sides"),
    flag("--prefill-batch-tokens", type=int, default=512,
                   help="the simulated prefill packs queued prompts up to this many uncached tokens, as the "
                        "live prefill does by default (its --prefill-batch-tokens; 0: one prompt at a time)"),
    flag("--warmup", type=int, default=2,
                   help="short completions sent (and not measured) before the replay, so it meets warm instances"),
    flag("--tokenizer", default="auto"),
    flag("--prompt-mode", choices=("text", "tokens"), default="text"),
    flag("--ready-timeout", type=float, default=300.0),
    flag("--plot", default=None, help="CDF plot path (default: OUT_DIR/fidelity_cdf.png)"),
    flag("--output-dir", default="fidelity-results"),
    flag("--held-out", type=int, default=0,
         help="also compare on the last K requests alone, simulated with the cost models exported just "
              "before they were sent: corrections not learned from them"),
    flag("--no-admission-outcomes", dest="admission_outcomes", action="store_false",
         help="skip judging admission by outcomes (one simulation per refused request)"),
    flag("--runs", type=int, default=1, help="replay the slice this many times, each on a fresh cluster, and "
         "give each figure's median and range and the admission outcomes pooled (runs.py); each run's "
         "report in OUTPUT_DIR/run-I"),
    flag("--json", action="store_true"),
)


def build_parser() -> argparse.ArgumentParser:
    return options.build_parser("mooncake bench fidelity", __doc__.split("\n\n")[0], FLAGS)


def main(argv: Sequence[str]) -> int:
    ns = freeze(build_parser().parse_args(list(argv)), "FidelityOptions")
    if ns.num_requests < 1 or ns.speed <= 0 or ns.block_tokens < 1 or ns.arrival_spread < 0 \
            or not 0 <= ns.burst_window <= 1 or ns.runs < 1 or (ns.runs > 1 and ns.conductor) \
            or not 0 <= ns.ttft_admit_margin < 1:
        sys.stderr.write("mooncake bench fidelity: error: -n, --speed, --block-tokens and --runs must be positive, "
                         "--arrival-spread >= 0, --burst-window between 0 and 1s, --ttft-admit-margin in [0, 1); "
                         "--runs above 1 starts its own clusters (no --conductor)\n")
        return 2
    try:
        report = one_run(ns) if ns.runs == 1 else repeated(ns.runs, lambda i: one_run(
            replace(ns, output_dir=str(Path(ns.output_dir) / f"run-{i}"), plot=None)))
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"mooncake bench fidelity: error: {exc}\n")
        return 2
    emit(report, lambda r: r["text"], as_json=ns.json)
    return 0


def one_run(ns: Options) -> dict:
    """One replay and its report, on a cluster this starts (and stops) unless ``--conductor``."""
    cluster = None
    try:
        if ns.conductor is None:
            cluster = start_cluster(ns)
        return run(ns, (ns.conductor or cluster.api).removesuffix("/v1"))
    finally:
        if cluster is not None:
            cluster.stop()


def run(ns: Options, api: str) -> dict:
    """Replay, export, simulate, compare: the report dict (``text``: the table)."""
    from mooncake_lite.bench.replay.metrics import prediction_errors
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lr = replay_live(ns, api, out)
    hw = live_profile(out / "costs.json", getattr(ns, "prefill_args", ""))
    trace = sim_trace(lr.window, lr.requests, lr.records, ns.block_tokens)
    if ns.ttft_slo and ns.tbt_slo:
        slos = {"ttft_slo_s": ns.ttft_slo, "tbt_slo_s": ns.tbt_slo, "how": "absolute on both sides"}
    else:
        slos = converted_slos([t.input_length for t in trace], hw, ns.ttft_slo_factor, ns.tbt_slo_factor)
    overtakes, jitter = live_overtakes(getattr(ns, "prefill_args", "")), delivery_jitter(lr.records, lr.timelines)

    def simulated(costs, decisions=None, jitter=jitter):   # queued as the live prefills queue, corrected as live
        return simulate(trace, costs, prefill=ns.prefill, decode=ns.decode, admission=ns.admission,
                        ttft_slo_s=ns.ttft_slo or None, tbt_slo_s=ns.tbt_slo or None, block=ns.block_tokens,
                        slo_factors=(ns.ttft_slo_factor, ns.tbt_slo_factor), batch_tokens=ns.prefill_batch_tokens,
                        overtakes=overtakes, correct=True, decisions=decisions, burst_window_s=ns.burst_window,
                        delivery_jitter=jitter, ttft_admit_margin=ns.ttft_admit_margin)
    decisions: list = []
    res = simulated(hw, decisions)
    live, sim = live_side(lr.records), sim_side(res)
    report = compare(live, sim, len(lr.records))
    report.update(without_each(live, hw, simulated, jitter, len(lr.records)), delivery_jitter_s=list(jitter))
    report.update(slos=slos, gaps=measured_gaps(live, lr.records, lr.before, lr.after, hw),
                  config={k: v for k, v in asdict(ns).items() if k != "token"}, served=lr.served,
                  live_wall_s=lr.live_s, live_failed=live.failed, simrejected_by=rejected_by(res),
                  predictions=prediction_errors(lr.records),   # the live conductor's own, per request
                  sim_predictions=simulated_predictions(trace, res, decisions),
                  prompt_tokens={"live": live.prompt_tokens, "sim": sim.prompt_tokens},
                  cost_model={"prefill": lr.profile.get("prefill"), "decode": lr.profile.get("decode"),
                              **{k: lr.profile.get(k) for k in PROFILE_KEYS}})
    report["per_request"] = per_request(lr.records, res)
    report["drift"] = machine_drift(lr.records, {t.request_id: t.input_length for t in trace}, lr.timelines, hw)
    if ns.held_out:
        report["held_out"] = held_out(ns, lr, trace, simulated, out)
    if ns.admission_outcomes:
        report["admission"] = admission_outcomes(ns, trace, lr.records, hw, slos, lr.timelines)
    plot = Path(ns.plot) if ns.plot else out / "fidelity_cdf.png"
    cdf_plot(plot, live, sim, f"{lr.served['model']} · first {len(lr.records)} requests · "
                              f"{ns.prefill}P+{ns.decode}D · {ns.speed:g}x · live vs sim (exported cost model)")
    report["plot"] = str(plot)
    report["text"] = report_text(report)
    (out / "fidelity.json").write_bytes(orjson.dumps({k: v for k, v in report.items() if k != "text"},
                                                     option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return report


def without_each(live, hw, simulated, jitter: tuple[float, ...], n: int) -> dict:
    """The same slice without each modelled effect (``sim.ablations``), and without the measured
    delivery jitter when there is one: what each moves, as ``sim_without_*`` rows."""
    others = {f"sim_{name}": (other, jitter) for name, other in ablations(hw).items()}
    if jitter:
        others["sim_without_delivery_jitter"] = (hw, ())
    return {key: compare(live, sim_side(simulated(costs, jitter=j)), n)["rows"] for key, (costs, j) in others.items()}


def held_out(ns: Options, lr, trace, simulated, out: Path) -> dict | None:
    """The last ``--held-out`` requests compared alone, the whole slice simulated with the models
    exported before they were sent (``costs_learned.json``): fidelity on requests the online
    correction did not learn from. None when the export was not taken (a slice too short)."""
    from types import SimpleNamespace

    path = out / "costs_learned.json"
    if not path.is_file():
        return None
    learned = live_profile(path, getattr(ns, "prefill_args", ""))
    ids = {t.request_id for t in trace[-ns.held_out:]}
    records = [r for r in lr.records if r.request_id in ids]
    # the jitter of the requests done when that export was taken (live.LEARN_LEAD_S before the first sent)
    until = min((r.send_s for r in records), default=math.inf) - LEARN_LEAD_S
    res = simulated(learned, jitter=delivery_jitter(lr.records, lr.timelines, until))
    kept = SimpleNamespace(requests=[r for r in res.requests if r.request_id in ids])
    cmp = compare(live_side(records), sim_side(kept), len(records))
    cmp["corrections"] = orjson.loads(path.read_bytes()).get("corrections")
    return cmp


def admission_outcomes(ns: Options, trace, records, hw, slos: dict, timelines: dict) -> dict:
    """Admission judged by its outcomes (``admission.py``): the live admitted requests' share that
    met their SLO, the refused ones' that would have by the simulator's counterfactual and by live's
    own timeline (``anchored.py``)."""
    from mooncake_lite.bench.fidelity import admission
    from mooncake_lite.bench.fidelity.anchored import live_anchor
    from mooncake_lite.bench.fidelity.sim import live_packing
    absolute = (ns.ttft_slo or None, ns.tbt_slo or None)   # as the simulated and live conductors take them
    limits = admission.applied(records, admission.slo_limits(hw, absolute, (ns.ttft_slo_factor, ns.tbt_slo_factor)))
    sim = admission.admitting_all(hw, absolute[0], slo_factors=(ns.ttft_slo_factor, ns.tbt_slo_factor),
                                  prefill=ns.prefill, decode=ns.decode, block=ns.block_tokens,
                                  batch_tokens=ns.prefill_batch_tokens,
                                  overtakes=live_overtakes(getattr(ns, "prefill_args", "")),
                                  burst_window_s=ns.burst_window)
    anchor = live_anchor(records, {t.request_id: t.input_length for t in trace}, timelines, hw.prefill.predict,
                         live_overtakes(getattr(ns, "prefill_args", "")), ns.burst_window,
                         live_packing(ns, hw.prefill))
    end_s = max((t.timestamp_ms for t in trace), default=0.0) / 1e3   # the last arrival (admission.judged)
    out = admission.judge(trace, admission.outcomes_of(records), limits, sim, anchor, end_s)
    out["turns_replayed"] = turns_replayed(timelines, live_overtakes(getattr(ns, "prefill_args", "")))
    stated = sum(r.slo_s[0] is not None for r in records)
    out["slos"] = "absolute, as given" if ns.ttft_slo and ns.tbt_slo else \
        f"per request, {ns.ttft_slo_factor:g}x prefill alone / {ns.tbt_slo_factor:g}x one step alone " \
        f"(as the conductor applied them, {stated} of {len(records)} stated; else by the exported model)"
    return out


def turns_replayed(timelines: Mapping, bound: int) -> dict[str, int]:
    """How far the prefills' records of turns replay to their own order (``scheduler/waiting.py``):
    turns given to the job the replay had at the head, of all turns; 0 of 0 without a record."""
    from mooncake_lite.scheduler.waiting import replay
    done = [replay(t["turns"], bound) for t in timelines.values() if t.get("turns")]
    return {"agreed": sum(r.agreed for r in done), "grants": sum(r.grants for r in done)}


# what the exported cost model adds to its prefill and decode fits (one-box effects), reported as is
PROFILE_KEYS = ("decode_max_context_tokens", "decode_step_ratios", "decode_busy_step_ratios",
                "decode_colocated_slowdown", "decode_padding_s_per_token", "decode_kv_write_s_per_token", "colocation",
                "prefill_idle", "prefill_busy")


def per_request(records: Sequence, res) -> list[dict]:
    """Each request's outcome on both sides (TTFT/TBT seconds, or its rejection), by id."""
    from mooncake_lite.bench.replay.metrics import ttft
    from mooncake_lite.common.tbt import paper_tbt
    sims = {r.request_id: r for r in res.requests}
    rows = []
    for rec in records:
        s = sims.get(rec.request_id)
        rows.append({"id": rec.request_id, "live_ttft": ttft(rec) if rec.is_ok else None,
                     "live_tbt": paper_tbt(token_gaps(rec)) if rec.is_ok else None, "live_status": rec.status,
                     "sim_ttft": s.ttft if s else None, "sim_tbt": s.tbt if s else None,
                     "sim_status": s.status if s else None, "input": s.input_length if s else None,
                     "live_cached_tokens": rec.cached_tokens, "sim_reused_tokens": s.reused_tokens if s else None,
                     "predicted_ttft": rec.predicted_ttft_s, "predicted_tbt": rec.predicted_tbt_s, "slo": rec.slo_s,
                     "bound_ttft": rec.bound_ttft_s,
                     "live_send_s": rec.send_s, "live_chunk_s": list(rec.chunk_s),   # for offline analysis
                     "completion_id": rec.completion_id, "placed": rec.num_placed})
    return rows
