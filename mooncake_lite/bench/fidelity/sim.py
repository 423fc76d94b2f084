"""``bench fidelity``'s simulated side: the replayed slice as the simulator sees it, the conductor's
SLOs (relative ones as relative: each request's own limits), the run with the cluster's exported
cost model, and the ablations (the same slice without each one-box effect that model has)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from mooncake_lite.bench.fidelity.live import server_tokens
from mooncake_lite.bench.fidelity.report import Side
from mooncake_lite.trace.format import TraceRequest



def converted_slos(prompt_tokens: Sequence[int], hw, ttft_factor: float, tbt_factor: float) -> dict:
    """What the conductor's relative SLOs come to on the slice, for people reading the report:
    each request's limits by the exported model (factor × its prefill alone; factor × one step
    alone with its prompt as context), their median and range. The simulated conductor judges
    each request by its own limit, as live (:func:`simulate` with ``slo_factors``), not these."""
    ttft = [ttft_factor * hw.prefill.predict(n) for n in prompt_tokens]
    tbt = [tbt_factor * hw.decode.predict(1, n) for n in prompt_tokens]
    return {"ttft_slo_s": statistics.median(ttft), "tbt_slo_s": statistics.median(tbt),
            "ttft_range_s": [min(ttft), max(ttft)], "tbt_range_s": [min(tbt), max(tbt)],
            "how": f"relative on both sides, {ttft_factor:g}x prefill alone / {tbt_factor:g}x one step alone per "
                   f"request; shown: their median over the slice (exported model)"}


def sim_trace(window: Sequence[TraceRequest], requests: Sequence, records: Sequence, block: int) -> list[TraceRequest]:
    """The slice as the simulator sees it: the server's prompt length (its tokenizer adds BOS;
    a request it never counted — rejected — gets the client's count plus the same offset), the
    output the client asked for and read, the trace's hash ids cut to the scaled length (one
    trace block = ``block`` tokens), the replay's arrival times (ms, relative to the first)."""
    offsets = [r.server_prompt_tokens - r.prompt_tokens for r in records if r.server_prompt_tokens is not None]
    offset = int(statistics.median(offsets)) if offsets else 0
    by_id = {r.request_id: r for r in records}
    t0 = requests[0].arrival_s if requests else 0.0
    out = []
    for tr, req in zip(window, requests):
        rec = by_id.get(req.request_id)
        n_in = server_tokens(rec) if rec is not None and rec.server_prompt_tokens is not None \
            else req.num_prompt_tokens + offset
        n_out = req.stop_after if req.stop_after is not None else req.max_tokens
        ids = tuple(tr.hash_ids[: max(1, math.ceil(n_in / block))])
        out.append(TraceRequest(tr.request_id, (req.arrival_s - t0) * 1e3, n_in, max(1, n_out), ids))
    return out


def simulate(trace: Sequence[TraceRequest], hw, *, prefill: int, decode: int, admission: str,
             ttft_slo_s: float | None, tbt_slo_s: float | None, block: int, batch_tokens: int = 0,
             overtakes: int = 0, correct: bool = False, decisions: list | None = None, burst_window_s: float = 0.0,
             slo_factors: tuple[float, float] = (10.0, 5.0), delivery_jitter: tuple[float, ...] = (),
             ttft_admit_margin: float = 0.0):
    """The slice simulated; an SLO None is relative by ``slo_factors`` (TTFT, TBT), as the live
    conductor's and its decodes'; ``overtakes``: the live prefills' queue-order bound (:func:`live_overtakes`),
    ``correct``: the live conductor's online correction, learned as the simulation runs;
    ``decisions``: a list the conductor's decisions are appended to, one per request in arrival order;
    ``delivery_jitter``: what the path to the client moves a gap by, measured (``delivery.py``);
    ``ttft_admit_margin``: the live conductor's (``SchedulerConfig``)."""
    from mooncake_lite.scheduler import SchedulerConfig
    from mooncake_lite.sim.cluster import MooncakeSim
    from mooncake_lite.sim.config import SimConfig
    sched = SchedulerConfig(admission=admission, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, block_size=block,
                            ttft_slo_factor=slo_factors[0], tbt_slo_factor=slo_factors[1],
                            ttft_admit_margin=ttft_admit_margin)
    cfg = SimConfig(num_prefill=prefill, num_decode=decode, hardware=hw.name, scheduler=sched,
                    max_tokens_policy="output", decode_check="reserve", prefill_batch_tokens=batch_tokens,
                    prefill_queue_overtakes=overtakes, correct=correct,
                    burst_window_s=burst_window_s)
    sim = MooncakeSim(cfg, replace(hw, block_size=block))
    sim.decisions = decisions
    for d in sim.decodes:   # the client's side of the box, not the decode's: the bench's to give
        d.batch.deliver_with(delivery_jitter)
    return sim.run(trace)


def simulated_predictions(trace: Sequence[TraceRequest], result, decisions: Sequence) -> dict:
    """The simulated conductor's own TTFT and TBT prediction errors on the slice (``error_figures``,
    in arrival order). Its forwards take exactly what the model says, so what is left is what no
    prediction at arrival can know: later arrivals passing or joining a job (shortest first,
    packing); FIFO leaves none. The live error is that plus the machine's. A request held for its
    burst (``--burst-window``) is predicted, as the live client is shown, its wait plus the decision's,
    its forward as its burst left it (``burst_shift_s``).
    Its TBT is the step for the batch foreseen at its first token × the tail learned (with ``correct``):
    what is left is batch mates joining mid-decode and the step spread, as live."""
    from mooncake_lite.bench.replay.metrics import error_figures
    held, shift = result.extra.get("held_s", {}), result.extra.get("burst_shift_s", {})
    predicted = {t.request_id: d.predicted_ttft_s + held.get(t.request_id, 0.0) + shift.get(t.request_id, 0.0)
                 for t, d in zip(trace, decisions) if d.predicted_ttft_s is not None}
    by_id = {r.request_id: r for r in result.requests}
    ratios = [r.ttft / p for t in trace if (r := by_id.get(t.request_id)) is not None and r.status == "completed"
              and r.ttft is not None and (p := predicted.get(t.request_id))]
    tbts = [r.tbt / d.predicted_tbt_s for t, d in zip(trace, decisions) if d.predicted_tbt_s
            and (r := by_id.get(t.request_id)) is not None and r.status == "completed" and r.tbt]
    return {"ttft": error_figures(ratios), "tbt": error_figures(tbts)}


def live_overtakes(prefill_args: str) -> int:
    """The queue-order bound the prefills this bench starts serve by: `mooncake up`'s order
    (shortest first, ``DEFAULT_OVERTAKES``) unless ``--prefill-args`` names another."""
    from mooncake_lite.scheduler.queue_order import bound_of
    known = _live_prefill_flags(prefill_args)
    return bound_of(known.queue_order, known.queue_overtakes)


def live_packing(ns, model):
    """How the prefills this bench starts pack (``anchored.Packing``): ``--prefill-batch-tokens``
    within a chunk, as the prefill's ``pack_limit`` and the simulator's nodes cut them."""
    from mooncake_lite.bench.fidelity.anchored import Packing
    batch, chunk = ns.prefill_batch_tokens, _live_prefill_flags(getattr(ns, "prefill_args", "")).prefill_chunk
    return Packing(min(batch, chunk) if batch > 0 else 0, model.shared_c0)


def live_profile(path, prefill_args: str):
    """The hardware a live export (``sim export-costs``) describes, its prefill run as the live
    prefills run it: a prompt over their chunk (the role's default ``--prefill-chunk`` unless
    ``--prefill-args`` names another) chunk by chunk, as their refiners fit the model."""
    from mooncake_lite.sim.costs import load_profile
    return load_profile(path).with_prefill_chunk(_live_prefill_flags(prefill_args).prefill_chunk)


def _live_prefill_flags(prefill_args: str):
    import argparse
    import shlex

    from mooncake_lite.cluster.plan import UP_QUEUE_ORDER
    from mooncake_lite.prefill.config import Config
    from mooncake_lite.scheduler.queue_order import DEFAULT_OVERTAKES
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--queue-order", default=UP_QUEUE_ORDER)
    ap.add_argument("--queue-overtakes", type=int, default=DEFAULT_OVERTAKES)
    ap.add_argument("--prefill-chunk", type=int, default=Config.prefill_chunk)
    return ap.parse_known_args(shlex.split(prefill_args or ""))[0]


def sim_side(result) -> Side:
    done = [r for r in result.requests if r.status == "completed"]
    return Side(ttft=tuple(r.ttft for r in done if r.ttft is not None),
                tbt=tuple(r.tbt for r in done if r.tbt is not None), completed=len(done),
                rejected=frozenset(r.request_id for r in result.requests if r.status == "rejected"),
                failed=sum(r.status not in ("completed", "rejected") for r in result.requests),
                prefix_hit_tokens=sum(r.reused_tokens for r in done),
                prompt_tokens=sum(r.input_length for r in done),
                hit_tokens={r.request_id: r.reused_tokens for r in done})


def ablations(hw) -> dict:
    """The exported hardware without each one-box effect it models (only those it has), and
    without all of them: the simulator as it ran before they were measured."""
    out = {}
    if hw.decode_step_ratios:
        out["without_step_spread"] = replace(hw, decode_step_ratios=(), decode_busy_step_ratios=())
    if hw.decode_padding_s_per_token:
        out["without_padded_context"] = replace(hw, decode_padding_s_per_token=0.0)
    if hw.decode_colocated_slowdown != 1.0:
        out["without_colocated_slowdown"] = replace(hw, decode_colocated_slowdown=1.0)
    if hw.decode_kv_write_s_per_token:
        out["without_kv_writes"] = replace(hw, decode_kv_write_s_per_token=0.0)
    if hw.prefill_busy is not None:   # every forward at the two states weighed, as the conductor prices
        out["without_node_states"] = replace(hw, prefill_idle=None, prefill_busy=None)
    if len(out) > 1:   # the delivery jitter is the bench's, not the model's: run without it (cli.py)
        out["without_any"] = replace(hw, decode_step_ratios=(), decode_busy_step_ratios=(),
                                     decode_padding_s_per_token=0.0, prefill_idle=None, prefill_busy=None,
                                     decode_colocated_slowdown=1.0, decode_kv_write_s_per_token=0.0)
    return out


def rejected_by(res) -> dict[str, int]:
    from collections import Counter
    return dict(Counter(f"{r.reject_stage}:{r.reject_cause}" for r in res.requests if r.status == "rejected"))
