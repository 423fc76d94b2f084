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
   writes a CDF plot, and the instances' step and forward timelines (``timelines.json``).

SLOs: the live conductor's default SLOs are relative (TTFT ≤ 10× the prompt's prefill alone, TBT ≤
5× one step alone, by the chosen instance's own profile); the simulator's are absolute. Without
``--ttft-slo``/``--tbt-slo`` the simulator gets the median over the slice of the per-request
limits the exported model gives (``scheduler.admission.slo_limits``); with them, both sides use
the same absolute SLOs (passed to the conductor this command starts).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from mooncake_lite.bench.fidelity.gaps import measured_gaps
from mooncake_lite.bench.fidelity.live import (conductor_config, decode_urls, export_profile, live_replay, live_side,
                                               replay_namespace, scrape_all, start_cluster, timelines, token_gaps,
                                               warm_up)
from mooncake_lite.bench.fidelity.report import cdf_plot, compare, report_text
from mooncake_lite.bench.fidelity.sim import ablations, converted_slos, rejected_by, sim_side, sim_trace, simulate
from mooncake_lite.model.source import DEFAULT_MODEL

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mooncake bench fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=DEFAULT_TRACE)
    # 30 requests at 0.03x: about 63% of one prefill instance on a 2-core box shared with other work
    p.add_argument("-n", "--num-requests", type=int, default=30, help="the first N requests of the trace")
    p.add_argument("--speed", type=float, default=0.03, help="replay speed (0.03: 3%% of the recorded rate)")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="tokens per 512-token trace block, and the cluster's KV block size")
    p.add_argument("--output-scale", type=float, default=1.0, help="output length scale")
    p.add_argument("--max-output-tokens", type=int, default=32, help="output cap")
    p.add_argument("--conductor", default=None, help="a running cluster's conductor URL (default: start one)")
    p.add_argument("--token", default=os.environ.get("MOONCAKE_CLUSTER_TOKEN"), help="its cluster token")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model of the cluster this command starts")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--admission", default="predictive", help="the conductor's admission (its default)")
    p.add_argument("--ttft-slo", type=float, default=None, help="absolute TTFT SLO, seconds, on both sides")
    p.add_argument("--tbt-slo", type=float, default=None, help="absolute TBT SLO, seconds, on both sides")
    p.add_argument("--ttft-slo-factor", type=float, default=10.0, help="the conductor's relative TTFT SLO")
    p.add_argument("--tbt-slo-factor", type=float, default=5.0, help="the conductor's relative TBT SLO")
    p.add_argument("--prefill-batch-tokens", type=int, default=512,
                   help="the simulated prefill packs queued prompts up to this many uncached tokens, as the "
                        "live prefill does by default (its --prefill-batch-tokens; 0: one prompt at a time)")
    p.add_argument("--warmup", type=int, default=2,
                   help="short completions sent (and not measured) before the replay, so it meets warm instances")
    p.add_argument("--tokenizer", default="auto")
    p.add_argument("--prompt-mode", choices=("text", "tokens"), default="text")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--plot", default=None, help="CDF plot path (default: OUT_DIR/fidelity_cdf.png)")
    p.add_argument("--output-dir", default="fidelity-results")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str]) -> int:
    ns = build_parser().parse_args(list(argv))
    if ns.num_requests < 1 or ns.speed <= 0 or ns.block_tokens < 1:
        sys.stderr.write("mooncake bench fidelity: error: -n, --speed and --block-tokens must be positive\n")
        return 2
    cluster = None
    try:
        if ns.conductor is None:
            cluster = start_cluster(ns)
        api = ns.conductor or cluster.api
        report = run(ns, api.removesuffix("/v1"))
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"mooncake bench fidelity: error: {exc}\n")
        return 2
    finally:
        if cluster is not None:
            cluster.stop()
    if ns.json:
        print(orjson.dumps(report, option=orjson.OPT_NON_STR_KEYS).decode())
    else:
        print(report["text"])
    return 0


def run(ns: argparse.Namespace, api: str) -> dict:
    """Replay, export, simulate, compare: the report dict (``text``: the table)."""
    from mooncake_lite.common.auth import cluster_headers
    from mooncake_lite.sim.costs import load_profile
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    status = conductor_config(api, ns.token)
    decodes = decode_urls(status)
    warm_up(api, ns.warmup)
    before = scrape_all(api, decodes)
    t0 = time.perf_counter()
    window, requests, records, served = asyncio.run(
        live_replay(replay_namespace(ns, api, str(out)), cluster_headers(None)))
    live_s = time.perf_counter() - t0
    after = scrape_all(api, decodes)
    profile = export_profile(api, ns.token, out / "costs.json")
    (out / "timelines.json").write_bytes(orjson.dumps(timelines(status, ns.token)))
    hw = load_profile(out / "costs.json")
    trace = sim_trace(window, requests, records, ns.block_tokens)
    if ns.ttft_slo and ns.tbt_slo:
        slos = {"ttft_slo_s": ns.ttft_slo, "tbt_slo_s": ns.tbt_slo, "how": "absolute on both sides"}
    else:
        slos = converted_slos([t.input_length for t in trace], hw, ns.ttft_slo_factor, ns.tbt_slo_factor)
    res = simulate(trace, hw, prefill=ns.prefill, decode=ns.decode, admission=ns.admission,
                   ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"], block=ns.block_tokens,
                   batch_tokens=ns.prefill_batch_tokens)
    live, sim = live_side(records), sim_side(res)
    report = compare(live, sim, len(records))
    for name, other in ablations(hw).items():   # the same slice without one modelled effect: what it moves
        res_other = simulate(trace, other, prefill=ns.prefill, decode=ns.decode, admission=ns.admission,
                             ttft_slo_s=slos["ttft_slo_s"], tbt_slo_s=slos["tbt_slo_s"], block=ns.block_tokens,
                             batch_tokens=ns.prefill_batch_tokens)
        report[f"sim_{name}"] = compare(live, sim_side(res_other), len(records))["rows"]
    report.update(slos=slos, gaps=measured_gaps(live, records, before, after, hw),
                  config={k: v for k, v in vars(ns).items() if k != "token"}, served=served,
                  live_wall_s=live_s, live_failed=live.failed, simrejected_by=rejected_by(res),
                  prompt_tokens={"live": live.prompt_tokens, "sim": sim.prompt_tokens},
                  cost_model={"prefill": profile.get("prefill"), "decode": profile.get("decode"),
                              "decode_max_context_tokens": profile.get("decode_max_context_tokens"),
                              "decode_step_ratios": profile.get("decode_step_ratios"),
                              "decode_colocated_slowdown": profile.get("decode_colocated_slowdown"),
                              "decode_padding_s_per_token": profile.get("decode_padding_s_per_token"),
                              "decode_kv_write_s_per_token": profile.get("decode_kv_write_s_per_token"),
                              "colocation": profile.get("colocation")})
    report["per_request"] = per_request(records, res)
    plot = Path(ns.plot) if ns.plot else out / "fidelity_cdf.png"
    cdf_plot(plot, live, sim, f"{served['model']} · first {len(records)} requests · {ns.prefill}P+{ns.decode}D · "
                              f"{ns.speed:g}x · live vs sim (exported cost model)")
    report["plot"] = str(plot)
    report["text"] = report_text(report)
    (out / "fidelity.json").write_bytes(orjson.dumps({k: v for k, v in report.items() if k != "text"},
                                                     option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    return report


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
                     "live_send_s": rec.send_s, "live_chunk_s": list(rec.chunk_s)})   # for offline analysis
    return rows
