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

``--device cuda`` runs it all on the GPU (every timer synchronises the device), measures the
roofs there, and prints the GPU's datasheet roofs beside the figures: MFU against its dense
peak for the dtype, decode's weight reads against HBM bandwidth, and the pinned host link
against PCIe (``bench/gpu_roofs.py``; "unknown" for a GPU not in its table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import orjson
import torch
from tqdm import tqdm

from kernels.timing import best_seconds, run_times, timed
from mooncake_lite.bench.model import gpu_roofs
from mooncake_lite.bench.host import cpu_description
from mooncake_lite.model.args import DTYPES, ModelArgs
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.linear import PACK_PROBE_ROWS, linear, pack_weight
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.source import DEFAULT_MODEL, NAMED_MODELS, resolve
from mooncake_lite.model.weights import build_model, model_args

BLOCK_SIZE = 16
DEFAULT_MODELS = ("tiny", "small", DEFAULT_MODEL)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mooncake bench model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None,
                    help=f"comma-separated model specs: presets, named models, .gguf files or HF checkpoint dirs "
                         f"(default: {','.join(DEFAULT_MODELS)})")
    ap.add_argument("--prompt-len", type=int, default=256, help="prefill length in tokens")
    ap.add_argument("--context-len", type=int, default=256, help="tokens already cached per decoding sequence")
    ap.add_argument("--batch-sizes", default="1,4,16", help="decode batch sizes")
    ap.add_argument("--decode-steps", type=int, default=6, help="timed decode steps per batch size")
    ap.add_argument("--repeats", type=int, default=2, help="timed prefills per model (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dtype", default="float32",
                    help="comma-separated model dtypes, each measured in the same run (e.g. float32,bfloat16)")
    ap.add_argument("--no-pack", action="store_true",
                    help="prefill and decode on the plain weights, not the oneDNN-packed copies the instances use")
    ap.add_argument("--profile", action="store_true",
                    help="also break a batch-1 decode step down by operator kind (torch.profiler)")
    ap.add_argument("--device", default="cpu", help="torch device to measure on (cpu, cuda, cuda:1)")
    ap.add_argument("--json", action="store_true", help="print all figures as one JSON object")
    args = ap.parse_args(list(argv))
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device: not a torch device: {args.device!r}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is false)")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    args.dtypes = [d for d in args.dtype.split(",") if d]
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        ap.error(f"--dtype takes {', '.join(sorted(DTYPES))}, got {args.dtype!r}")
    args.default_models = args.models is None
    args.models = list(DEFAULT_MODELS) if args.models is None else [m for m in args.models.split(",") if m]
    for name in ("prompt_len", "context_len", "decode_steps", "repeats"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not args.models or min(args.batch_sizes) <= 0:
        ap.error("need at least one model and positive batch sizes")
    return args


# --- machine limits -------------------------------------------------------------------------------
def matmul_gflops(n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """The faster of the two float32 kernels the model runs on, on one large product: torch's
    ``mm`` (MKL's sgemm on x86) and oneDNN's on a packed weight where there is one. On an AVX-512
    EPYC oneDNN ran twice MKL's rate, so a roof of ``mm`` alone was passed by the model itself."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = best_seconds(lambda: torch.mm(a, b), device, repeats, warmup=1)
    packed = pack_weight(b.t().contiguous())    # a @ b == linear(a, b.T)
    if packed is not None:
        best = min(best, best_seconds(lambda: linear(a, b, packed=packed), device, repeats, warmup=1))
    return 2 * n**3 / best / 1e9


def copy_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Read + write bandwidth of one large copy (bytes moved counted both ways)."""
    src = torch.ones(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_seconds(lambda: dst.copy_(src), device, repeats, warmup=1) / 1e9


def read_gbps(num_bytes: int = 256 << 20, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bandwidth of one large read (a sum): what a decode step's weight reads could reach, since
    they write almost nothing. Shown beside the copy roof, which the goals are stated against."""
    src = torch.ones(num_bytes // 4, device=device)
    return num_bytes / best_seconds(lambda: src.sum(), device, repeats, warmup=1) / 1e9


# --- what each model is -------------------------------------------------------------------------------
def describe_model(spec: str) -> dict:
    """What ``spec`` names: a preset with seeded dummy weights, or a real checkpoint (and where)."""
    source = resolve(spec)
    if source.kind == "preset":
        return {"kind": "preset", "weights": "dummy (seeded random)", "path": None,
                "description": f"preset {spec!r} with seeded dummy weights"}
    description = (NAMED_MODELS[spec].description if spec in NAMED_MODELS
                   else f"{'GGUF file' if source.kind == 'gguf' else 'HF checkpoint'} {source.served_name}")
    if source.kind == "gguf":
        description += " (dequantized, then cast to the dtype measured)"
    return {"kind": source.kind, "weights": "checkpoint", "path": source.path, "description": description}


def usable_models(models: Sequence[str], *, drop_missing: bool) -> tuple[dict[str, float], list[str]]:
    """({model: seconds its shape took to read}, notes). A bad spec raises now, not after a
    minute of measuring; with ``drop_missing`` (the default list) a named model whose package is
    absent is skipped with a note. The time is the first read of a checkpoint's header/config
    (a GGUF's metadata, vocabulary included), part of what loading it costs."""
    keep, notes = {}, []
    for name in models:
        t0 = time.perf_counter()
        try:
            model_args(name)
        except FileNotFoundError as exc:
            if not (drop_missing and name in NAMED_MODELS):
                raise
            notes.append(f"skipped {name}: {exc}")
            continue
        keep[name] = time.perf_counter() - t0
    return keep, notes


# --- model cost -------------------------------------------------------------------------------------
def layer_matmul_params(a: ModelArgs) -> int:
    kv = a.num_kv_heads * a.head_dim
    return a.num_layers * (2 * a.dim * a.q_width + 2 * a.dim * kv + 3 * a.dim * a.ffn_dim)


def prefill_flops(a: ModelArgs, num_tokens: int) -> float:
    """Useful FLOPs of a prefill from position 0; the head runs on the last position only."""
    attention = 4 * a.num_layers * a.q_width * num_tokens * (num_tokens + 1) / 2  # QK^T and PV, causal
    return 2 * layer_matmul_params(a) * num_tokens + attention + 2 * a.dim * a.vocab_size


def decode_flops(a: ModelArgs, batch: int, context_len: int) -> float:
    per_token = 2 * (layer_matmul_params(a) + a.dim * a.vocab_size) + 4 * a.num_layers * a.q_width * context_len
    return batch * per_token


def weight_bytes(a: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes a decode step must read: every matmul weight (the embedding lookup reads one row)."""
    return (layer_matmul_params(a) + a.dim * a.vocab_size) * torch.empty((), dtype=dtype).element_size()


# --- measurements -----------------------------------------------------------------------------------
def bench_prefill(runner: ModelRunner, prompt_len: int, repeats: int, bar: tqdm) -> list[float]:
    """Seconds of each timed whole-prompt prefill (after one warm-up)."""
    tokens = [(7 * i) % runner.args.vocab_size for i in range(prompt_len)]
    table = list(range(blocks_needed(prompt_len, runner.block_size)))
    times = run_times(lambda: runner.prefill(tokens, table, 0), runner.device, repeats, warmup=1)
    bar.update(repeats + 1)
    return times


def bench_decode(runner: ModelRunner, batch: int, context_len: int, steps: int, bar: tqdm) -> list[float]:
    """Seconds of each timed decode step for ``batch`` sequences of ``context_len`` cached tokens
    (after one warm-up step; each step one position further)."""
    per_seq = blocks_needed(context_len + steps + 1, runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    positions = iter(range(context_len, context_len + steps + 1))
    times = run_times(lambda: runner.decode([11] * batch, tables, [next(positions)] * batch), runner.device,
                      steps, warmup=1)
    bar.update(steps + 1)
    return times


def bench_matmuls(model: Transformer, rows: int, repeats: int = 3) -> float:
    """Best seconds of one decode step's matmuls alone at ``rows`` rows: every layer's q/k/v,
    output, gate/up and down products and the head, in the step's order, on the weights (and
    packed copies) the step uses, so each weight streams from memory as it does there. The floor
    under the step, to which attention and the small ops add."""
    a = model.args
    param = next(model.parameters())
    x, attn, ffn = (torch.randn(rows, width, device=param.device, dtype=param.dtype)
                    for width in (a.dim, a.q_width, a.ffn_dim))

    def step() -> None:
        for block in model.layers.values():
            att, mlp = block.attention, block.feed_forward
            linear(x, *att.qkv, packed=att.packs.get("qkv"))
            linear(attn, att.wo.weight, packed=att.packs.get("wo"))
            linear(x, mlp.gate_up, packed=mlp.packs.get("gate_up"))
            linear(ffn, mlp.w2.weight, packed=mlp.packs.get("w2"))
        if model.is_last:
            linear(x, model.output.weight, packed=model.output_pack)
    return best_seconds(step, param.device, repeats, warmup=1)


# Operator kinds of a decode step, by the aten names torch.profiler records (first match wins).
OP_KINDS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn::_linear")),
            ("attention", ("aten::_scaled_dot_product", "aten::softmax", "aten::_softmax")),
            ("kv write", ("aten::index_copy", "aten::index_put", "aten::_index_put")),
            ("kv gather", ("aten::index_select", "aten::index")))


def profile_decode(runner: ModelRunner, context_len: int, steps: int = 4) -> dict:
    """Milliseconds per batch-1 decode step by operator kind (self CPU time), and the rest of the
    wall time: Python, dispatch and everything the profiler does not attribute to an operator."""
    from torch.profiler import ProfilerActivity, profile
    per_seq = blocks_needed(context_len + steps + 2, runner.block_size)
    table = [list(range(per_seq))]

    def run_steps() -> None:
        for step in range(steps):
            runner.decode([11], table, [context_len + 1 + step])

    runner.decode([11], table, [context_len])   # warm-up outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed(run_steps, runner.device)
    kinds = {kind: 0.0 for kind, _ in OP_KINDS} | {"other ops": 0.0}
    for event in prof.key_averages():
        kind = next((k for k, prefixes in OP_KINDS if event.key.startswith(prefixes)), "other ops")
        kinds[kind] += event.self_cpu_time_total / 1e3 / steps
    kinds["outside ops"] = max(wall * 1e3 / steps - sum(kinds.values()), 0.0)
    # Profiling slows every op a little: read these as shares of the step, not as its time.
    return {"step_ms_profiled": wall * 1e3 / steps, "ms_per_step": kinds}


def bench_one(name: str, args: argparse.Namespace, peak_gflops: float, peak_gbps: float, bar: tqdm,
              header_s: float = 0.0, dtype: str = "float32", gpu: dict | None = None) -> dict:
    source = describe_model(name)
    t0 = time.perf_counter()
    model = build_model(name, dtype=DTYPES[dtype], device=getattr(args, "device", "cpu"))
    source["build_s"] = time.perf_counter() - t0
    source["load_s"] = header_s + source["build_s"]   # header/config, then the weights
    margs = model.args
    if args.prompt_len > margs.max_seq_len or args.context_len + args.decode_steps + 1 > margs.max_seq_len:
        raise ValueError(f"{name}: lengths exceed max_seq_len {margs.max_seq_len}")
    per_seq = blocks_needed(max(args.prompt_len, args.context_len + args.decode_steps + 1), BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks=per_seq * max(args.batch_sizes), block_size=BLOCK_SIZE)
    # Median is the typical figure; the best run is compared with the roofs (themselves best-of),
    # since on a shared machine both are otherwise dominated by whoever else holds the cores.
    # prefill as a prefill instance runs it (``--pack-weights auto``): packed where that is faster here
    gain = None if getattr(args, "no_pack", False) else model.pack_if_faster_(min(args.prompt_len, PACK_PROBE_ROWS))
    times = bench_prefill(runner, args.prompt_len, args.repeats, bar)
    best_s = min(times)
    gflops = prefill_flops(margs, args.prompt_len) / best_s / 1e9
    out = {
        "source": source,
        "dtype": dtype,
        "params": margs.num_params(),
        "prefill": {"tokens": args.prompt_len, "seconds": statistics.median(times), "seconds_best": best_s,
                    "tokens_per_s": args.prompt_len / statistics.median(times),
                    "tokens_per_s_best": args.prompt_len / best_s,
                    "gflops_best": gflops, "fraction_of_matmul_peak": gflops / peak_gflops,
                    "packed": model.packed, "packing_speedup": gain},
        "decode": {},
    }
    if gpu is not None:
        out["prefill"] |= gpu_roofs.fractions(gpu, dtype, gflops * 1e9)
    wbytes = weight_bytes(margs, runner.dtype)
    if not getattr(args, "no_pack", False):
        model.pack_()   # as a decode instance runs (a no-op where prefill packed already)
    out["decode_packed"] = model.packed
    for batch in args.batch_sizes:
        times = bench_decode(runner, batch, args.context_len, args.decode_steps, bar)
        step_s, best_s = statistics.median(times), min(times)
        gflops = decode_flops(margs, batch, args.context_len) / best_s / 1e9
        matmul_s = bench_matmuls(model, batch)
        matmul_gflops = 2 * batch * (layer_matmul_params(margs) + margs.dim * margs.vocab_size) / matmul_s / 1e9
        out["decode"][str(batch)] = {
            "step_ms": step_s * 1e3, "step_ms_best": best_s * 1e3, "tokens_per_s": batch / step_s,
            "gflops_best": gflops, "fraction_of_matmul_peak": gflops / peak_gflops,
            "weight_gbps_best": wbytes / best_s / 1e9,
            "fraction_of_copy_bandwidth": wbytes / best_s / 1e9 / peak_gbps,
            "matmuls_ms_best": matmul_s * 1e3, "matmuls_fraction_of_matmul_peak": matmul_gflops / peak_gflops,
        }
        if batch != 1 and "1" in out["decode"]:   # median steps, as a multiple of the batch-1 step
            out["decode"][str(batch)]["step_over_batch1"] = step_s * 1e3 / out["decode"]["1"]["step_ms"]
        if gpu is not None:
            out["decode"][str(batch)] |= gpu_roofs.fractions(gpu, dtype, gflops * 1e9, wbytes / best_s)
    if args.profile:
        out["decode_profile"] = profile_decode(runner, args.context_len)
    return out


def run(args: argparse.Namespace) -> dict:
    header_s, notes = usable_models(args.models, drop_missing=args.default_models)
    args.models = list(header_s)
    if not args.models:
        raise ValueError("no model to measure: " + "; ".join(notes))
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
        gpu = gpu_roofs.gpu_machine(args.device) if args.device.type == "cuda" else None
        bar.update(1)
        models = {}
        for name in args.models:
            for dtype in args.dtypes:
                bar.set_postfix_str(f"{name} {dtype}")
                key = name if len(args.dtypes) == 1 else f"{name} {dtype}"
                with torch.inference_mode():
                    models[key] = bench_one(name, args, peak, bandwidth, bar, header_s[name], dtype, gpu)
    # Load average: on a shared machine, other work steals cycles from both roofs and model runs.
    return {"machine": {"threads": torch.get_num_threads(), "matmul_gflops": peak, "copy_gbps": bandwidth,
                        "read_gbps": read, "cpu_count": os.cpu_count(), "cpu": cpu_description(),
                        "load_average_1m": os.getloadavg()[0],
                        "device": str(args.device), "gpu": gpu},
            "settings": {"prompt_len": args.prompt_len, "context_len": args.context_len,
                         "decode_steps": args.decode_steps, "block_size": BLOCK_SIZE, "dtype": args.dtype},
            "models": models, "notes": notes}


def _packing(p: dict) -> str:
    """How prefill ran: on packed or plain weights, and the speedup the choice was made on."""
    gain = p.get("packing_speedup")
    if gain is None:
        return ""
    return f"; {'packed' if p.get('packed') else 'plain'} weights (packed measured {gain:.2f}x)"


def render(res: dict) -> str:
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
        lines.append(f"\n{name} ({r['params'] / 1e6:.1f}M params in {r['dtype']}; {src['description']}; "
                     f"loaded in {src['load_s']:.2f} s; decode on {'packed' if r.get('decode_packed') else 'plain'} "
                     f"weights)")
        lines.append(f"  prefill: {p['tokens_per_s']:9.0f} tokens/s (best {p['tokens_per_s_best']:.0f})  "
                     f"best {p['gflops_best']:7.2f} GFLOP/s = {100 * p['fraction_of_matmul_peak']:5.1f}% of matmul peak"
                     + _packing(p))
        if "mfu" in p:
            lines.append(gpu_roofs.render_prefill(p))
        for batch, d in r["decode"].items():
            lines.append(f"  decode batch {batch:>3}: step {d['step_ms']:8.2f} ms (best {d['step_ms_best']:7.2f})  "
                         f"{d['tokens_per_s']:8.1f} tokens/s  best: {100 * d['fraction_of_matmul_peak']:5.1f}% of "
                         f"matmul peak, weights {d['weight_gbps_best']:6.2f} GB/s = "
                         f"{100 * d['fraction_of_copy_bandwidth']:5.1f}% of copy")
            ratio = f"; step = {d['step_over_batch1']:.2f}x batch 1's" if "step_over_batch1" in d else ""
            lines.append(f"      its matmuls alone {d['matmuls_ms_best']:7.2f} ms "
                         f"({100 * d['matmuls_fraction_of_matmul_peak']:5.1f}% of matmul peak){ratio}")
            if "mfu" in d:
                lines.append(gpu_roofs.render_decode(d))
        if "decode_profile" in r:
            prof = r["decode_profile"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in prof["ms_per_step"].items())
            lines.append(f"  decode batch 1 profiled ({prof['step_ms_profiled']:.1f} ms/step), ms per step: {parts}")
    lines += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.stderr.write(f"mooncake bench model: error: {exc}\n")
        return 2
    print(orjson.dumps(res).decode() if args.json else render(res))
    return 0
