"""``mooncake bench model``: prefill tokens/s and decode step time on this machine, next to its limits.

Step times are medians; the best run is what is compared with the limits. The limits are measured in the same run: a large float32 matmul (GFLOP/s, the
faster of MKL's and oneDNN's kernels: the compute roof that prefill approaches) and a large tensor copy (GB/s, the memory roof that small-batch decode hits,
since every step reads all weights). Each figure is reported as a fraction of its roof, using
the model's useful FLOPs per token (matmuls plus causal attention) and its weight bytes.
Decode runs on a cache whose context holds placeholder KV: step cost depends on context length,
not on its values, so no prefill is needed per batch size. Prefill runs as a prefill instance
does (``--pack-weights auto``): on oneDNN-packed weights where they measure faster on this CPU.
Decode runs as a decode instance does, on oneDNN-packed weights where there are some (CPU float32; ``--no-pack``: the plain
path); beside each batch's step, the same step's matmuls alone at that many rows (the floor
under the step) and its time as a multiple of the batch-1 step. ``--json`` prints one JSON object.

``--models`` takes any model spec: a preset (seeded dummy weights), a named packaged checkpoint
(``smollm2-135m``), a GGUF file or an HF checkpoint directory. The default list puts the real
default model beside the presets (skipped with a note where its package is not installed);
each model's entry says which kind it is and how long loading it took.

``--tp N`` measures instead a decode step and a prefill split across N tensor-parallel rank
processes beside the same at TP=1, and the collectives' share of each (``bench/model/tp.py``);
models N does not divide are skipped with a note.

``--device cuda`` runs it all on the GPU (every timer synchronises the device), measures the
roofs there, and prints the GPU's datasheet roofs beside the figures: MFU against its dense
peak for the dtype, decode's weight reads against HBM bandwidth, and the pinned host link
against PCIe (``bench/model/gpu_roofs.py``; "unknown" for a GPU not in its table).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch
from tqdm import tqdm

from mooncake_lite.bench.host import cpu_description
from mooncake_lite.bench.model import gpu_roofs
from mooncake_lite.bench.model.peer_rounds import peer_figures, render_rounds
from mooncake_lite.bench.model.measure import BLOCK_SIZE, Roofs, bench_one
from mooncake_lite.bench.model.roofs import copy_gbps, matmul_gflops, read_gbps
from mooncake_lite.bench.model.sources import model_list, usable_models
from mooncake_lite.bench.model.tp import bench_tp, render_tp
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import run_and_emit
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.gguf_loader import WEIGHT_MODES
from mooncake_lite.model.source import DEFAULT_MODEL, resolve
from mooncake_lite.model.tensor_parallel import check_divides
from mooncake_lite.model.weights import model_args

DEFAULT_MODELS = ("tiny", "small", DEFAULT_MODEL)
FLAGS = (
    flag("--models", default=None, help=f"comma-separated model specs: presets, named models, .gguf files or HF "
                                        f"checkpoint dirs (default: {','.join(DEFAULT_MODELS)})"),
    flag("--prompt-len", type=int, default=256, help="prefill length in tokens"),
    flag("--context-len", type=int, default=256, help="tokens already cached per decoding sequence"),
    flag("--batch-sizes", default="1,4,16", help="decode batch sizes"),
    flag("--decode-steps", type=int, default=6, help="timed decode steps per batch size"),
    flag("--repeats", type=int, default=2, help="timed prefills per model (median reported)"),
    flag("--threads", type=int, default=None, help="torch threads (default: torch's choice)"),
    flag("--dtype", default="float32",
         help="comma-separated model dtypes, each measured in the same run (e.g. float32,bfloat16)"),
    flag("--weights", default="quantized,dequantize",
         help="comma-separated: a GGUF's quantized weights kept as its blocks (quantized) and/or dequantized "
              "at load (dequantize), each measured in the same run (other models run once)"),
    flag("--llamacpp", default=None, metavar="PYTHON",
         help="a Python with llama-cpp-python installed: llama.cpp's batch-1 decode on each GGUF model, "
              "measured in the same run as the peer"),
    flag("--peer-rounds", type=int, default=1,
         help="with --llamacpp: also N rounds alternating our batch-1 decode and llama.cpp's (same load)"),
    flag("--no-pack", action="store_true",
         help="prefill and decode on the plain weights, not the oneDNN-packed copies the instances use"),
    flag("--profile", action="store_true",
         help="also break a batch-1 decode step down by operator kind (torch.profiler)"),
    flag("--tp", type=int, default=None,
         help="compare TP=1 with this many tensor-parallel ranks (gloo on CPU, NCCL on GPUs)"),
    flag("--device", default="cpu", help="torch device to measure on (cpu, cuda, cuda:1)"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
)


def parse_args(argv: Sequence[str]) -> Options:
    """The flags as one frozen value: ``device`` a torch device, ``batch_sizes``, ``dtypes`` and
    ``models`` lists, ``default_models`` whether the list is the default one."""
    ap = build_parser("mooncake bench model", __doc__, FLAGS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ns = ap.parse_args(list(argv))
    try:
        device = torch.device(ns.device)
    except RuntimeError:
        ap.error(f"--device: not a torch device: {ns.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
    try:
        batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated integers, got {ns.batch_sizes!r}")
    dtypes = [d for d in ns.dtype.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtype takes {', '.join(sorted(DTYPES))}, got {ns.dtype!r}")
    weights = [w for w in ns.weights.split(",") if w]
    if not weights or any(w not in WEIGHT_MODES for w in weights):
        ap.error(f"--weights takes {', '.join(WEIGHT_MODES)}, got {ns.weights!r}")
    models, is_default = model_list(ns.models, DEFAULT_MODELS)
    for name in ("prompt_len", "context_len", "decode_steps", "repeats", "peer_rounds"):
        if getattr(ns, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if ns.tp is not None and ns.tp < 2:
        ap.error("--tp must be at least 2 (it is compared with TP=1)")
    if not models or min(batch_sizes) <= 0:
        ap.error("need at least one model and positive batch sizes")
    return freeze(ns, "ModelOptions", device=device, batch_sizes=batch_sizes, dtypes=dtypes, models=models,
                  default_models=is_default, weights=weights)


def run(args: Options) -> dict:
    header_s, notes = usable_models(args.models, drop_missing=args.default_models)
    args = replace(args, models=list(header_s))
    if args.tp:
        return run_tp(args, notes)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps_per_model = args.repeats + 1 + len(args.batch_sizes) * (args.decode_steps + 1)
    with tqdm(total=2 + steps_per_model * len(args.models) * len(args.dtypes), desc="bench model", unit="run",
              file=sys.stderr, disable=None, leave=False) as bar:
        bar.set_postfix_str("matmul peak")
        peak = matmul_gflops(device=args.device)
        bar.update(1)
        bar.set_postfix_str("copy bandwidth")
        bandwidth = copy_gbps(device=args.device)
        read = read_gbps(device=args.device)
        roofs = Roofs(peak, bandwidth, gpu_roofs.gpu_machine(args.device) if args.device.type == "cuda" else None)
        bar.update(1)
        models, peers = {}, {}
        for name in args.models:
            gguf = resolve(name).kind == "gguf"
            for dtype in args.dtypes:
                for weights in args.weights if gguf else args.weights[:1]:
                    key = " ".join([name, *([dtype] if len(args.dtypes) > 1 else []),
                                    *([weights] if gguf and len(args.weights) > 1 else [])])
                    bar.set_postfix_str(key)
                    with torch.inference_mode():
                        models[key] = bench_one(name, args, roofs, bar, header_s[name], dtype, weights)
            if gguf and args.llamacpp:
                bar.set_postfix_str(f"{name} llama.cpp")
                peers[name] = peer_figures(name, args.llamacpp, rounds=args.peer_rounds,
                                           context_len=args.context_len, steps=args.decode_steps, bar=bar)
    # Load average: on a shared machine, other work steals cycles from both roofs and model runs.
    return {"machine": {"threads": torch.get_num_threads(), "matmul_gflops": peak, "copy_gbps": roofs.copy_gbps,
                        "read_gbps": read, "cpu_count": os.cpu_count(), "cpu": cpu_description(),
                        "load_average_1m": os.getloadavg()[0], "device": str(args.device), "gpu": roofs.gpu},
            "settings": {"prompt_len": args.prompt_len, "context_len": args.context_len,
                         "decode_steps": args.decode_steps, "block_size": BLOCK_SIZE, "dtype": args.dtype},
            "models": models, "peers": peers, "notes": notes}


def run_tp(args: Options, notes: list[str]) -> dict:
    models = {}
    for name in args.models:
        try:
            check_divides(model_args(name), args.tp)
        except ValueError as exc:
            notes.append(f"skipped {name}: {exc}")
            continue
        models[name] = bench_tp(name, args.tp, threads=args.threads, prompt_len=args.prompt_len,
                                context_len=args.context_len, steps=args.decode_steps, repeats=args.repeats,
                                dtype=args.dtypes[0], device=args.device.type, pack=not args.no_pack)
    return {"machine": {"cpu_count": os.cpu_count(), "cpu": cpu_description(), "device": str(args.device),
                        "load_average_1m": os.getloadavg()[0]},
            "settings": {"prompt_len": args.prompt_len, "context_len": args.context_len, "tp": args.tp,
                         "dtype": args.dtypes[0]},
            "tp_models": models, "notes": notes}


def _render_tp(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    lines = [f"machine ({m['device']}): {m.get('cpu') or m['cpu_count']}, load average {m['load_average_1m']:.1f}; "
             f"prefill {s['prompt_len']} tokens, decode batch 1 at {s['context_len']} cached tokens, {s['dtype']}"]
    for name, r in res["tp_models"].items():
        lines += render_tp(name, r)
    return "\n".join(lines + [f"note: {n}" for n in res.get("notes", [])])


def _packing(p: dict) -> str:
    """How prefill ran: on packed or plain weights, and the speedup the choice was made on."""
    gain = p.get("packing_speedup")
    if gain is None:
        return ""
    return f"; {'packed' if p.get('packed') else 'plain'} weights (packed measured {gain:.2f}x)"


def render(res: dict) -> str:
    if "tp_models" in res:
        return _render_tp(res)
    m = res["machine"]
    s = res["settings"]
    lines = [f"machine ({m.get('device', 'cpu')}): {m['threads']} threads, float32 matmul "
             f"{m['matmul_gflops']:.1f} GFLOP/s, copy {m['copy_gbps']:.1f} GB/s, read {m['read_gbps']:.1f} GB/s "
             f"(load average {m['load_average_1m']:.1f}; {m.get('cpu') or str(m['cpu_count']) + ' CPUs'})",
             f"prefill {s['prompt_len']} tokens; decode with {s['context_len']} cached tokens per sequence"]
    if m.get("gpu"):
        lines.append(gpu_roofs.render_machine(m["gpu"]))
    for name, r in res["models"].items():
        p = r["prefill"]
        src = r["source"]
        active = f", {r['active_params'] / 1e6:.1f}M active" if r["active_params"] != r["params"] else ""
        held = ("GGUF blocks kept" if r.get("weights") == "quantized" and r.get("bits_per_weight", 32) < 16
                else "packed" if r.get("decode_packed") else "plain")
        lines.append(f"\n{name} ({r['params'] / 1e6:.1f}M params{active} in {r['dtype']}; {src['description']}; "
                     f"loaded in {src['load_s']:.2f} s; decode on {held} weights: {r['bits_per_weight']:.2f} bits "
                     f"a weight, {r['weight_bytes'] / 1e6:.1f} MB read a step)")
        lines.append(f"  prefill: {p['tokens_per_s']:9.0f} tokens/s (best {p['tokens_per_s_best']:.0f})  "
                     f"best {p['gflops_best']:7.2f} GFLOP/s = {100 * p['fraction_of_matmul_peak']:5.1f}% of matmul peak"
                     + _packing(p))
        if "mfu" in p:
            lines.append(gpu_roofs.render_prefill(p))
        for batch, d in r["decode"].items():
            kv = f"with the KV read, {d['kv_bytes_read'] / 1e6:.1f} MB: {100 * d['fraction_of_copy_bandwidth_with_kv']:.1f}%"
            lines.append(f"  decode batch {batch:>3}: step {d['step_ms']:8.2f} ms (best {d['step_ms_best']:7.2f})  "
                         f"{d['tokens_per_s']:8.1f} tokens/s  best: {100 * d['fraction_of_matmul_peak']:5.1f}% of "
                         f"matmul peak, weights {d['weight_gbps_best']:6.2f} GB/s = "
                         f"{100 * d['fraction_of_copy_bandwidth']:5.1f}% of copy ({kv})")
            ratio = f"; step = {d['step_over_batch1']:.2f}x batch 1's" if "step_over_batch1" in d else ""
            if d["matmuls_ms_best"] is not None:
                lines.append(f"      its matmuls alone {d['matmuls_ms_best']:7.2f} ms "
                             f"({100 * d['matmuls_fraction_of_matmul_peak']:5.1f}% of matmul peak), the rest "
                             f"{100 * d['outside_matmuls_share']:4.1f}% of the step{ratio}")
            if "mfu" in d:
                lines.append(gpu_roofs.render_decode(d))
        if "decode_profile" in r:
            prof = r["decode_profile"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in prof["ms_per_step"].items())
            lines.append(f"  decode batch 1 profiled ({prof['step_ms_profiled']:.1f} ms/step), ms per step: {parts}")
    lines += _peer_lines(res)
    lines += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


def _peer_lines(res: dict) -> list[str]:
    """llama.cpp on each GGUF file beside our batch-1 and batch-16 decode of the same file."""
    lines = []
    for name, peer in res.get("peers", {}).items():
        if "error" in peer:
            lines.append(f"\nllama.cpp on {name}: did not run ({peer['error']})")
            continue
        lines.append(f"\nllama.cpp {peer['version']} on {name} ({peer['threads']} threads, {peer['context_len']} "
                     f"cached tokens): batch-1 decode {peer['token_ms']:.2f} ms a token (best {peer['token_ms_best']:.2f})")
        for key, r in res["models"].items():
            if key.split(" ")[0] != name:
                continue
            for batch, d in r["decode"].items():
                per_token = d["step_ms"] / int(batch)
                lines.append(f"  ours ({key}) batch {batch:>3}: {per_token:7.2f} ms a token = "
                             f"{peer['token_ms'] / per_token:5.2f}x llama.cpp's token rate")
        if "rounds" in peer:
            lines += render_rounds(name, peer["rounds"])
    return lines


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    return run_and_emit("mooncake bench model", lambda: run(args), render, as_json=args.json,
                        errors=(ValueError, FileNotFoundError))
