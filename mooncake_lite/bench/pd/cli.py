"""``mooncake bench pd``: the prefill/decode data path on this machine.

All times are the best of ``--repeats`` runs (other load on the machine can only add time).

(a) **overlap**: TTFT of one prefill whose KV goes to a real decode process, three ways — compute
    only (KV discarded), compute then send (all KV sent after the last layer), and layer-wise
    streaming (the role's path). The transfer time is what compute-then-send spends after its
    last layer until decode has acknowledged everything; the exposed time is the same tail when
    streaming. Hidden share = 1 - exposed / transfer (target >= 0.8). Measuring the tails inside
    each run keeps the estimate out of the noise of whole-TTFT differences on a busy machine.
    The whole-TTFT share (then_send - streaming) / (then_send - compute_only) is reported too; on
    one machine it also charges streaming for the decode process's CPU use during compute.
(b) **prefix**: TTFT of the same prompt with 0..75% of it cached in the store, next to the share
    of tokens still computed (a prefix hit must cut TTFT in proportion).
(c) **cpp**: TTFT of a long prompt (``--cpp-prompt-factor`` x the prompt, fresh tokens each run) on a 2-stage CPP group (T/2 threads per stage) vs one instance
    with T threads, both as real processes driven over HTTP.
(d) **decode**: tokens/s against batch size, and each step's time vs the memory roof (every
    step reads all weights once).
(e) **burst**: ``--burst N`` prompts of ``--burst-len`` tokens arrive at one prefill instance at
    once (the role's service, its KV to a real decode process); TTFT of each, with prefill batching
    (``--burst-tokens``, the role's ``--prefill-batch-tokens``) against one prompt at a time, runs
    interleaved; the ratio batched/unbatched of the mean and of the last TTFT (best of the runs),
    and the conductor's predicted TTFTs for both (its scheduler, from a start-up profile).
``--profile FILE`` writes the fitted prefill/decode cost models in the scheduler's ``to_dict``
format (``mooncake sim --cost-model FILE`` reads it); ``--json`` prints every figure as one object.

``--models`` takes any model spec (preset, named model such as ``smollm2-135m``, .gguf file, HF
checkpoint directory); the default list runs the real default model beside the ``tiny`` preset
(skipped with a note where its package is not installed). Each model's entry says whether its
weights are seeded dummies or a checkpoint, and how long loading them took.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import replace

import orjson
import torch

from mooncake_lite.bench.harness import LOCAL, role
from mooncake_lite.bench.model.flops import weight_bytes
from mooncake_lite.bench.model.roofs import copy_gbps, matmul_gflops
from mooncake_lite.bench.model.sources import describe_model, model_list, usable_models
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.pd.burst import bench_burst
from mooncake_lite.bench.pd.cpp import bench_cpp
from mooncake_lite.bench.pd.overlap import bench_overlap_and_prefix
from mooncake_lite.bench.pd.roles import BLOCK
from mooncake_lite.bench.report import run_and_emit
from mooncake_lite.instance.profile import profile_decode, profile_prefill, time_decode
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import DEFAULT_MODEL, resolve

DEFAULT_MODELS = ("tiny", DEFAULT_MODEL)
# (a)/(b) prompt tokens per model; a 30-layer real model gets a shorter one so a default run stays short
DEFAULT_PROMPT_LENS = {"tiny": 1024, "small": 512, DEFAULT_MODEL: 256}
OTHER_PROMPT_LEN = 512
# (c) prompt = factor x the model's prompt; 2 for the real model (its 1024-token CPP runs, in three
# more processes that each load the checkpoint, would double a default run's time)
DEFAULT_CPP_FACTOR = 4
DEFAULT_CPP_FACTORS = {DEFAULT_MODEL: 2}


FLAGS = (
    flag("--models", default=None, help=f"comma-separated model specs: presets, named models, .gguf files or HF "
                                        f"checkpoint dirs (default: {','.join(DEFAULT_MODELS)})"),
    flag("--prompt-len", default=None, help="prompt tokens per model (name=N,...) or one N (default: "
         + ",".join(f"{k}={v}" for k, v in DEFAULT_PROMPT_LENS.items()) + f", {OTHER_PROMPT_LEN} for others)"),
    flag("--chunk", type=int, default=256, help="prefill chunk tokens"),
    flag("--cpp-prompt-factor", type=int, default=None,
         help=f"(c) prompt = this x the model's prompt length (default: {DEFAULT_CPP_FACTOR}; "
              + ", ".join(f"{k}: {v}" for k, v in DEFAULT_CPP_FACTORS.items()) + ")"),
    flag("--repeats", type=int, default=3, help="timed runs per figure (the best is reported)"),
    flag("--batch-sizes", default="1,2,4,8,16,32", help="decode batch sizes"),
    flag("--context-len", type=int, default=256, help="cached tokens per decoding sequence"),
    flag("--threads", type=int, default=2, help="total torch threads (CPP: split across stages)"),
    flag("--device", default="cpu",
         help="torch device of the model here and in every role process (cpu, cuda, cuda:1)"),
    flag("--burst", type=int, default=16, help="(e) prompts arriving at once (0: skip)"),
    flag("--burst-len", type=int, default=100, help="(e) tokens per burst prompt"),
    flag("--burst-tokens", type=int, default=512,
         help="(e) prefill batching budget (--prefill-batch-tokens) of the batched runs"),
    flag("--no-cpp", dest="cpp", action="store_false", help="skip (c), which starts processes"),
    flag("--profile", metavar="FILE", help="write the fitted cost models of the first model here"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
    flag("--link", action="append", metavar="RATE",
         help="instead of (a)-(e): prefill and decode on two nodes over a link shaped to RATE (e.g. "
              "1gbit; repeat for more rates): hidden share and link share (needs root; bench/link/pd.py)"),
)


def parse_args(argv: Sequence[str]) -> Options:
    """The flags as one frozen value, with ``models``, ``batch_sizes``, ``prompt_lens`` and
    ``cpp_lens`` (per model) derived from them."""
    ap = build_parser("mooncake bench pd", __doc__, FLAGS, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.parse_args(list(argv))
    models, is_default = model_list(a.models, DEFAULT_MODELS)
    try:
        batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
        prompt_lens = _prompt_lens(a.prompt_len, models)
    except ValueError:
        ap.error("--batch-sizes and --prompt-len must be integers (--prompt-len: N or name=N,...)")
    cpp_lens = {m: n * (a.cpp_prompt_factor or DEFAULT_CPP_FACTORS.get(m, DEFAULT_CPP_FACTOR))
                for m, n in prompt_lens.items()}
    if not models or min(batch_sizes) <= 0 or a.chunk <= 0 or a.repeats <= 0 or a.threads <= 0 \
            or min(prompt_lens.values()) <= 0 or (a.cpp_prompt_factor is not None and a.cpp_prompt_factor <= 0) \
            or a.burst < 0 or a.burst_len <= 0 or a.burst_tokens <= 0:
        ap.error("need models and positive sizes")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
    return freeze(a, "PdOptions", models=models, default_models=is_default, batch_sizes=batch_sizes,
                  prompt_lens=prompt_lens, cpp_lens=cpp_lens)


def _prompt_lens(value: str | None, models: Sequence[str]) -> dict[str, int]:
    """``N`` for every model, or ``name=N,...`` over the defaults (a model spec is split at its
    last ``=``, so a path may hold one)."""
    if value is not None and "=" not in value:
        return dict.fromkeys(models, int(value))
    lens = dict(DEFAULT_PROMPT_LENS)
    for item in (value or "").split(","):
        if item:
            name, _, n = item.rpartition("=")
            lens[name] = int(n)
    return {m: lens.get(m, OTHER_PROMPT_LEN) for m in models}


def bench_decode(runner: ModelRunner, a: Options, peak_gbps: float) -> list[dict]:
    floor = weight_bytes(runner.args, runner.dtype) / (peak_gbps * 1e9)
    rows = []
    for batch in a.batch_sizes:
        if not runner.allocator.can_allocate(batch * (-(-a.context_len // runner.block_size))):
            break
        t = time_decode(runner, batch, a.context_len, repeats=a.repeats)
        rows.append({"batch": batch, "step_s": t, "tokens_per_s": batch / t, "memory_roof_share": floor / t})
    return rows


def run(a: Options) -> dict:
    header_s, notes = usable_models(a.models, drop_missing=a.default_models)
    a = replace(a, models=list(header_s))
    # (a), (b), (d) run here while a decode process receives: half the threads each, so torch's
    # spinning worker threads do not fight over the cores (that makes timings erratic).
    torch.set_num_threads(max(1, a.threads // 2))
    res = {"machine": {"threads": a.threads, "matmul_gflops": matmul_gflops(device=a.device),
                       "copy_gbps": copy_gbps(device=a.device), "device": a.device},
           "models": {}, "notes": notes}
    for name in a.models:
        n = a.prompt_lens[name]
        blocks = max(2 * (max(n, a.cpp_lens[name]) // BLOCK + 2), 2 * a.burst * -(-(a.burst_len + 1) // BLOCK))
        with role("decode", "--model", name, "--block-size", str(BLOCK), "--no-profile", "--num-blocks", str(blocks),
                  "--threads", "1", "--device", a.device, *LOCAL) as decode:
            part = asyncio.run(bench_overlap_and_prefix(name, a, decode))
            runner = part.pop("runner")
            build_s = part.pop("build_s")
            part["source"] = {**describe_model(name), "build_s": build_s, "load_s": header_s[name] + build_s}
            part["decode"] = bench_decode(runner, a, res["machine"]["copy_gbps"])
            if a.burst:
                part["burst"] = asyncio.run(bench_burst(runner, a, decode))
            prefill_cost, _ = profile_prefill(runner, [(64, 0), (n // 2, 0), (n, 0), (n // 4, n // 2),
                                                       (n // 2, n // 4), (n // 8, n - n // 8)], repeats=a.repeats)
            decode_cost, _ = profile_decode(runner, [(b, c) for b in a.batch_sizes[:4] for c in (64, a.context_len)])
            part["cost"] = {"prefill": prefill_cost.to_dict(), "decode": decode_cost.to_dict(),
                            "kv_bytes_per_token": runner.args.kv_bytes_per_token(runner.dtype)}
            if a.cpp:
                part["cpp"] = bench_cpp(name, a, decode, a.cpp_lens[name], runner.args.vocab_size)
        part["prompt_len"] = n
        res["models"][name] = part
    return res


def profile_dict(name: str, part: dict) -> dict:
    return {"name": f"{resolve(name).served_name}-cpu", **part["cost"], "block_size": BLOCK,
            "bandwidth_bytes_per_s": part["overlap"]["stream_gbps"] * 1e9}


def render(res: dict) -> str:
    m = res["machine"]
    lines = [f"machine: {m['threads']} threads, matmul {m['matmul_gflops']:.1f} GFLOP/s, copy {m['copy_gbps']:.1f} GB/s"]
    for name, p in res["models"].items():
        lines += render_model(name, p)
    lines += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


def render_model(name: str, p: dict) -> list[str]:
    """One model's parts (a) to (e); (e)'s lines are :func:`render_burst`'s."""
    o = p["overlap"]
    lines = [f"\n{name} ({p['prompt_len']} tokens, {o['kv_bytes'] / 2**20:.1f} MiB of KV; "
             f"{p['source']['description']}, loaded in {p['source']['load_s']:.2f} s)",
             f"  (a) TTFT compute-only {o['ttft_compute_only_s'] * 1e3:.1f} ms (the plain forward "
             f"{o['forward_s'] * 1e3:.1f} ms: served {o['served_over_forward']:.2f}x), compute-then-send "
             f"{o['ttft_then_send_s'] * 1e3:.1f} ms, layer-wise streaming {o['ttft_streaming_s'] * 1e3:.1f} ms",
             f"      transfer {o['transfer_s'] * 1e3:.1f} ms ({o['stream_gbps']:.2f} GB/s), exposed when "
             f"streaming {o['exposed_transfer_s'] * 1e3:.1f} ms -> hidden: {o['hidden_share']:.0%} (target >= 80%)",
             f"      whole-TTFT view (then_send - streaming) / (then_send - compute_only): "
             f"{'below noise' if o['ttft_hidden_share'] is None else format(o['ttft_hidden_share'], '.0%')}; compute ran {o['compute_slowdown_streaming']:.2f}x slower while "
             f"streaming (decode shares this machine's cores)"]
    lines += [f"  (b) cached {r['cached_tokens']:>5} tokens: TTFT {r['ttft_s'] * 1e3:8.1f} ms = "
              f"{r['ttft_share']:.2f} of uncached (computes {r['computed_share']:.2f} of the tokens)"
              for r in p["prefix"]]
    if "cpp" in p:
        c = p["cpp"]
        lines.append(f"  (c) {c['prompt_len']} tokens: TTFT one instance {c['ttft_one_instance_s'] * 1e3:.1f} ms vs 2-stage CPP "
                     f"{c['ttft_cpp_2_stages_s'] * 1e3:.1f} ms (speedup {c['speedup']:.2f}x)")
    lines += [f"  (d) batch {r['batch']:>3}: {r['tokens_per_s']:8.1f} tokens/s, step {r['step_s'] * 1e3:.2f} ms "
              f"({r['memory_roof_share']:.0%} of the memory roof)" for r in p["decode"]]
    return lines + (render_burst(p["burst"]) if "burst" in p else [])


def render_burst(b: dict) -> list[str]:
    """(e): the burst's TTFTs batched and one at a time, the conductor's predictions of them, and
    one layer's attention varlen against padded."""
    lines = [f"  (e) burst of {b['prompts']} x {b['prompt_len']} tokens: mean TTFT batched "
             f"{b['mean_ttft_batched_s'] * 1e3:.1f} ms vs one at a time {b['mean_ttft_unbatched_s'] * 1e3:.1f} ms "
             f"({b['mean_ratio']:.2f}x), last {b['last_ttft_batched_s'] * 1e3:.1f} vs "
             f"{b['last_ttft_unbatched_s'] * 1e3:.1f} ms ({b['last_ratio']:.2f}x); budget {b['batch_tokens']} "
             f"tokens, {b['packed_forwards']} packed forwards"]
    if "predicted_mean_ttft_batched_s" in b:
        lines.append("      conductor's predicted TTFT (mean, last) over measured: batched "
                     f"{b['predicted_mean_ttft_batched_s'] / b['mean_ttft_batched_s']:.2f}x, "
                     f"{b['predicted_last_ttft_batched_s'] / b['last_ttft_batched_s']:.2f}x; one at a time "
                     f"{b['predicted_mean_ttft_unbatched_s'] / b['mean_ttft_unbatched_s']:.2f}x, "
                     f"{b['predicted_last_ttft_unbatched_s'] / b['last_ttft_unbatched_s']:.2f}x; batched "
                     "priced one at a time (a conductor told nothing) "
                     f"{b['predicted_mean_ttft_unbatched_s'] / b['mean_ttft_batched_s']:.2f}x, "
                     f"{b['predicted_last_ttft_unbatched_s'] / b['last_ttft_batched_s']:.2f}x")
    for label, key in (("equal lengths", "attention_equal"), ("lengths 0.5-1.5x", "attention_spread")):
        t = b[key]
        lines.append(f"      one layer's attention, {label}: varlen {t['varlen_s'] * 1e3:.2f} ms, padded batch "
                     f"{t['padded_s'] * 1e3:.2f} ms ({t['padded_over_varlen']:.2f}x)")
    return lines


def main(argv: Sequence[str]) -> int:
    a = parse_args(argv)
    if a.link:
        from mooncake_lite.bench.link import pd as link_pd
        return link_pd.pd_main(a)
    return run_and_emit("mooncake bench pd", lambda: run_and_profile(a), render, as_json=a.json,
                        errors=(ValueError, FileNotFoundError))


def run_and_profile(a: Options) -> dict:
    """:func:`run`, then (``--profile FILE``) the first model's fitted cost models written to FILE."""
    res = run(a)
    if a.profile:
        name = next(iter(res["models"]))
        with open(a.profile, "wb") as fh:
            fh.write(orjson.dumps(profile_dict(name, res["models"][name]), option=orjson.OPT_INDENT_2))
    return res
