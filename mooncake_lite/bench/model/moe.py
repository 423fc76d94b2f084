"""``mooncake bench moe``: what MLA's latent saves in KV bytes, and what routing to experts costs.

KV (computed from the shapes, no timing): bytes per token and per block, and the seconds a
``--prompt-len`` prompt's KV takes at ``--gbps`` (the conductor's transfer estimate,
``scheduler.kv_transfer_time``), for a DeepSeek-V3-shaped model (MLA: one 512 + 64 latent row per
token and layer) against dense models of the same width and depth: grouped-query attention with 8
KV heads of 128 (56 query heads: LLaMA-style) and the per-head K/V MLA's heads would cache
expanded (128 heads of 192 + 128).

Routing overhead (timed): decode steps of an MoE preset (dummy weights) at each batch size against
the same model with every sparse layer's experts replaced by one dense MLP of the active width
(``top_k × expert_ffn_dim``, plus the shared experts'), steps of the two interleaved round by round
timed in process CPU seconds on ``--threads`` threads (1: the step's own work, which a machine
shared with other jobs leaves measurable where wall time does not); the ratios of the medians and
of the best steps are the figures.

Expert placement at tensor parallelism (computed, no timing): for the published shapes at
``--tp`` ranks, the busiest rank's share of a sparse layer's expert work when each expert is split
by width over the ranks (every rank runs every touched expert, 1/N of each: perfectly even) and
when whole experts are placed per rank (expert parallelism: a rank runs only its experts, so the
step waits for the rank the batch's tokens chose most). Tokens pick ``top_k`` distinct experts
uniformly at random (``--trials`` batches per size, seeded); real routers are skewed, which only
makes placement's busiest rank busier. Weight bytes (the decode roof) follow the touched experts;
rows × width (the compute roof) follow the (token, expert) pairs.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from mooncake_kernels.timing import run_times
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import run_and_emit
from mooncake_lite.model.args import PRESETS, ModelArgs, dtype_bytes
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.family import build_transformer
from mooncake_lite.model.weights import init_dummy_weights
from mooncake_lite.scheduler import kv_transfer_time

BLOCK = 16   # the timed runs' cache block size (it does not change a step's work)
FLAGS = (
    flag("--model", default="tiny-moe", help="MoE preset whose routing is timed"),
    flag("--batch-sizes", default="1,16", help="decode batch sizes"),
    flag("--context-len", type=int, default=64, help="tokens cached per decoding sequence"),
    flag("--threads", type=int, default=1, help="torch threads for the timed steps"),
    flag("--rounds", type=int, default=7, help="timed rounds (one MoE and one dense step each) per batch size"),
    flag("--block-size", type=int, default=64, help="tokens per KV block, for the per-block bytes"),
    flag("--prompt-len", type=int, default=8192, help="prompt whose KV transfer time is estimated"),
    flag("--gbps", type=float, default=25.0, help="transfer bandwidth, GB/s (25: a 200 Gb/s RDMA NIC)"),
    flag("--kv-dtype", default="bfloat16", help="KV element type for the byte figures"),
    flag("--tp", type=int, default=8, help="tensor-parallel ranks for the expert-placement figures"),
    flag("--trials", type=int, default=200, help="random batches per size for the expert-placement figures"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
)


def dense_peers(mla: ModelArgs) -> dict[str, ModelArgs]:
    """Dense attention of ``mla``'s width and depth: GQA-8 with 128-wide heads, and the expanded
    per-head K/V (MLA's own heads, keys ``qk_head_dim`` and values ``v_head_dim`` wide, which
    cost as many bytes as ``heads`` K/V pairs of their mean width)."""
    m = mla.mla
    gqa = dataclasses.replace(mla, num_heads=mla.dim // 128, num_kv_heads=8, head_size=128, mla=None, name="gqa-8")
    expanded = dataclasses.replace(mla, num_kv_heads=mla.num_heads, head_size=(m.qk_head_dim + m.v_head_dim) // 2,
                                   mla=None, name="expanded-mha")
    return {"gqa-8": gqa, "expanded-mha": expanded}


def kv_figures(args: Options) -> dict:
    mla = PRESETS["deepseek-v3"]
    out = {}
    for name, shape in {"deepseek-v3 (mla)": mla, **dense_peers(mla)}.items():
        per_token = shape.kv_bytes_per_token(args.kv_dtype)
        out[name] = {"bytes_per_token": per_token, "bytes_per_block": shape.kv_block_bytes(args.block_size, args.kv_dtype),
                     "transfer_s": kv_transfer_time(per_token * args.prompt_len, args.gbps * 1e9)}
    base = out["deepseek-v3 (mla)"]["bytes_per_token"]
    for fig in out.values():
        fig["over_mla"] = fig["bytes_per_token"] / base
    return out


def placement(args: Options) -> dict:
    """Per published MoE shape and batch size: the busiest rank's touched experts and (token,
    expert) pairs, experts split by width against placed whole, as means over random batches."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in ("deepseek-v3", "qwen3-30b-a3b"):
        m, n = PRESETS[name].moe, args.tp
        if m.num_experts % n:
            continue
        per_rank = m.num_experts // n
        rows = {}
        for batch in args.batch_sizes:
            ratios = {"split_experts": [], "placed_experts": [], "weight_bytes": [], "rows": []}
            for _ in range(args.trials):
                ids = torch.rand(batch, m.num_experts, generator=gen).topk(m.top_k, dim=-1).indices.flatten()
                pairs = torch.bincount(ids // per_rank, minlength=n)                  # per rank
                touched = torch.bincount(ids.unique() // per_rank, minlength=n)
                union = int(touched.sum())
                ratios["split_experts"].append(union / n)   # 1/N of each touched expert's weights
                ratios["placed_experts"].append(int(touched.max()))
                ratios["weight_bytes"].append(int(touched.max()) * n / union)
                ratios["rows"].append(int(pairs.max()) * n / len(ids))
            rows[str(batch)] = {k: statistics.mean(v) for k, v in ratios.items()}
        out[name] = {"tp": n, "experts": m.num_experts, "top_k": m.top_k, "batches": rows}
    return out


def dense_twin(args: ModelArgs) -> ModelArgs:
    """The same model with every layer's experts one dense MLP of the active width."""
    m = args.moe
    active = (m.top_k + m.num_shared_experts) * m.expert_ffn_dim
    return dataclasses.replace(args, moe=None, ffn_dim=active, name=f"{args.name}-dense-active")


def routing_overhead(args: Options) -> dict:
    preset = PRESETS[args.model]   # every layer sparse: a dense first layer would be the same in both
    moe_args = dataclasses.replace(preset, moe=dataclasses.replace(preset.moe, dense_layers=()))
    models = {"moe": _built(moe_args), "dense": _built(dense_twin(moe_args))}
    torch.set_num_threads(args.threads)
    out = {}
    for batch in args.batch_sizes:
        per_seq = blocks_needed(args.context_len + 1, BLOCK)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        runners = {k: ModelRunner(m, num_blocks=batch * per_seq, block_size=BLOCK) for k, m in models.items()}
        steps = {k: [] for k in runners}
        for _ in range(args.rounds):   # interleaved: one step of each per round, after one untimed
            for k, runner in runners.items():
                steps[k] += run_times(lambda: runner.decode([11] * batch, tables, [args.context_len] * batch),
                                      runner.device, 1, warmup=1, clock=time.process_time)
        ms = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
        best = {k: min(v) * 1e3 for k, v in steps.items()}
        out[str(batch)] = {"moe_step_ms": ms["moe"], "dense_step_ms": ms["dense"], "moe_over_dense": ms["moe"] / ms["dense"],
                           "moe_step_ms_best": best["moe"], "dense_step_ms_best": best["dense"],
                           "moe_over_dense_best": best["moe"] / best["dense"]}
    return {"model": args.model, "active_params": moe_args.active_params(), "threads": args.threads, "steps": out}


def _built(a: ModelArgs):
    model = build_transformer(a)
    init_dummy_weights(model)
    return model.eval().fuse_().pack_()   # as a decode instance runs it


def parse_args(argv: Sequence[str]) -> Options:
    ap = build_parser("mooncake bench moe", __doc__, FLAGS)
    ns = ap.parse_args(list(argv))
    if ns.tp < 1 or ns.trials < 1:
        ap.error(f"--tp and --trials must be at least 1, got {ns.tp} and {ns.trials}")
    if ns.model not in PRESETS or PRESETS[ns.model].moe is None:
        ap.error(f"--model must be an MoE preset ({', '.join(k for k, v in PRESETS.items() if v.moe)}), got {ns.model!r}")
    try:
        batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
        dtype_bytes(ns.kv_dtype)
    except (ValueError, KeyError):
        ap.error("--batch-sizes takes comma-separated integers and --kv-dtype float32, bfloat16 or float16")
    return freeze(ns, "MoEOptions", batch_sizes=batch_sizes)


def run(args: Options) -> dict:
    return {"kv": kv_figures(args), "block_size": args.block_size, "prompt_len": args.prompt_len,
            "gbps": args.gbps, "kv_dtype": args.kv_dtype, "routing": routing_overhead(args),
            "placement": placement(args)}


def render(res: dict) -> str:
    lines = [f"KV per token and per {res['block_size']}-token block ({res['kv_dtype']}), and a "
             f"{res['prompt_len']}-token prompt's transfer at {res['gbps']:g} GB/s:"]
    for name, f in res["kv"].items():
        lines.append(f"  {name:<18} {f['bytes_per_token']:>10,} B/token {f['bytes_per_block']:>13,} B/block "
                     f"{f['transfer_s'] * 1e3:9.1f} ms  {f['over_mla']:6.2f}x MLA")
    r = res["routing"]
    lines.append(f"decode step CPU time on {r['threads']} thread(s), {r['model']} (all layers sparse) vs one dense MLP "
                 "of the active width:")
    for batch, s in r["steps"].items():
        lines.append(f"  batch {batch:>3}: median moe {s['moe_step_ms']:8.2f} ms  dense {s['dense_step_ms']:8.2f} ms  "
                     f"= {s['moe_over_dense']:.2f}x;  best {s['moe_step_ms_best']:8.2f} / {s['dense_step_ms_best']:8.2f} ms "
                     f"= {s['moe_over_dense_best']:.2f}x")
    for name, p in res["placement"].items():
        lines.append(f"experts at TP={p['tp']}, {name} ({p['experts']} experts, top {p['top_k']}; uniform routing): "
                     "the busiest rank's share, placed whole / split by width")
        for batch, b in p["batches"].items():
            lines.append(f"  batch {batch:>4}: experts read {b['placed_experts']:6.2f} whole vs {b['split_experts']:6.2f} "
                         f"expert-equivalents = {b['weight_bytes']:.2f}x the weight bytes; {b['rows']:.2f}x the rows")
    return "\n".join(lines)


def main(argv: Sequence[str] = tuple(sys.argv[1:])) -> int:
    args = parse_args(argv)
    return run_and_emit("mooncake bench moe", lambda: run(args), render, as_json=args.json)
