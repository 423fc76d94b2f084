"""The timings of ``bench model``: whole-prompt prefills, decode steps per batch size, a step's
matmuls alone, a profiled step by operator kind, and one model's figures against the roofs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from mooncake_kernels.timing import best_seconds, run_times, timed
from mooncake_lite.bench.model import gpu_roofs
from mooncake_lite.bench.model.flops import (decode_flops, held_weight_bytes, matmul_weights, weight_bytes,
                                             prefill_flops)
from mooncake_lite.bench.model.sources import describe_model
from mooncake_lite.bench.options import Options
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.linear import PACK_PROBE_ROWS, linear
from mooncake_lite.model.llama import Transformer
from mooncake_lite.model.moe import MoE
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.weights import build_model

BLOCK_SIZE = 16


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


def bench_matmuls(model: Transformer, rows: int, repeats: int = 3) -> float | None:
    """Best seconds of one decode step's matmuls alone at ``rows`` rows: every layer's q/k/v,
    output, gate/up and down products and the head, in the step's order, on the weights (and
    packed copies) the step uses, so each weight streams from memory as it does there. The floor
    under the step, to which attention and the small ops add. None for a model with experts or
    MLA: which weights a step reads depends on its routing."""
    a = model.args
    if a.moe is not None or a.mla is not None:
        return None
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
OP_KINDS = (("layers in one C call", ("decode_layers",)),   # kernels/decode_layers.c: products, attention, all
            ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn::_linear", "quant_linear")),
            ("attention", ("aten::_scaled_dot_product", "aten::softmax", "aten::_softmax", "decode_attention")),
            # rope_kv_write (kernels/rope_kv.c): the rotary embedding and the KV write in one call
            ("kv write", ("aten::index_copy", "aten::index_put", "aten::_index_put", "rope_kv_write")),
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


@dataclass(frozen=True)
class Roofs:
    """What a model's figures are fractions of: this machine's matmul rate and copy bandwidth, and
    the GPU's datasheet roofs (``gpu_roofs.gpu_machine``) on CUDA."""
    matmul_gflops: float
    copy_gbps: float
    gpu: dict | None = None


def bench_one(name: str, args: Options, roofs: Roofs, bar: tqdm, header_s: float = 0.0, dtype: str = "float32",
              weights: str = "quantized") -> dict:
    """One model in one dtype (a GGUF's quantized weights kept or ``weights="dequantize"``d):
    built as the instances build it, then its prefill, its decode steps at each batch size and
    (``--profile``) a profiled batch-1 step."""
    source = describe_model(name)
    t0 = time.perf_counter()
    model = build_model(name, dtype=DTYPES[dtype], device=args.device, weights=weights)
    source["build_s"] = time.perf_counter() - t0
    source["load_s"] = header_s + source["build_s"]   # header/config, then the weights
    margs = model.args
    if args.prompt_len > margs.max_seq_len or args.context_len + args.decode_steps + 1 > margs.max_seq_len:
        raise ValueError(f"{name}: lengths exceed max_seq_len {margs.max_seq_len}")
    per_seq = blocks_needed(max(args.prompt_len, args.context_len + args.decode_steps + 1), BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks=per_seq * max(args.batch_sizes), block_size=BLOCK_SIZE)
    held = held_weight_bytes(model)
    out = {"source": source, "dtype": dtype, "params": margs.num_params(), "active_params": margs.active_params(),
           "weights": weights, "weight_bytes": held, "bits_per_weight": 8 * held / matmul_weights(margs),
           "prefill": measure_prefill(model, runner, args, roofs, bar, dtype), "decode": {}}
    if not args.no_pack:
        model.pack_()   # as a decode instance runs (a no-op where prefill packed already)
    out["decode_packed"] = model.packed
    out["decode"] = measure_decode(model, runner, args, roofs, bar, dtype)
    if args.profile:
        out["decode_profile"] = profile_decode(runner, args.context_len)
    return out


def measure_prefill(model: Transformer, runner: ModelRunner, args: Options, roofs: Roofs, bar: tqdm,
                    dtype: str) -> dict:
    """Prefill as a prefill instance runs it (``--pack-weights auto``: packed where that is faster
    here). The median is the typical figure; the best run is compared with the roofs (themselves
    best-of), since on a shared machine both are otherwise dominated by whoever holds the cores."""
    gain = None if args.no_pack else model.pack_if_faster_(min(args.prompt_len, PACK_PROBE_ROWS))
    times = bench_prefill(runner, args.prompt_len, args.repeats, bar)
    best_s = min(times)
    gflops = prefill_flops(model.args, args.prompt_len) / best_s / 1e9
    out = {"tokens": args.prompt_len, "seconds": statistics.median(times), "seconds_best": best_s,
           "tokens_per_s": args.prompt_len / statistics.median(times), "tokens_per_s_best": args.prompt_len / best_s,
           "gflops_best": gflops, "fraction_of_matmul_peak": gflops / roofs.matmul_gflops,
           "packed": model.packed, "packing_speedup": gain}
    if roofs.gpu is not None:
        out |= gpu_roofs.fractions(roofs.gpu, dtype, gflops * 1e9)
    return out


def measure_decode(model: Transformer, runner: ModelRunner, args: Options, roofs: Roofs, bar: tqdm, dtype: str) -> dict:
    """Each batch size's decode step against both roofs, beside its matmuls alone at that many rows."""
    margs, out = model.args, {}
    held = held_weight_bytes(model)   # what a step reads: compact blocks where the model kept them
    for batch in args.batch_sizes:
        times = bench_decode(runner, batch, args.context_len, args.decode_steps, bar)
        touched = sum(b.feed_forward.num_touched for b in model.layers.values() if isinstance(b.feed_forward, MoE))
        wbytes = weight_bytes(margs, runner.dtype, touched) if margs.moe is not None else held
        step_s, best_s = statistics.median(times), min(times)
        kv_read = batch * args.context_len * margs.kv_bytes_per_token(runner.cache.kv.dtype)   # K and V attended
        gflops = decode_flops(margs, batch, args.context_len) / best_s / 1e9
        matmul_s = bench_matmuls(model, batch)
        matmul_gflops = None if matmul_s is None else 2 * batch * matmul_weights(margs) / matmul_s / 1e9
        out[str(batch)] = {
            "step_ms": step_s * 1e3, "step_ms_best": best_s * 1e3, "tokens_per_s": batch / step_s,
            "gflops_best": gflops, "fraction_of_matmul_peak": gflops / roofs.matmul_gflops,
            "weight_gbps_best": wbytes / best_s / 1e9,
            "fraction_of_copy_bandwidth": wbytes / best_s / 1e9 / roofs.copy_gbps,
            # the bytes a step reads that are not weights: the cached K and V its attention reads
            "kv_bytes_read": kv_read, "fraction_of_copy_bandwidth_with_kv": (wbytes + kv_read) / best_s / 1e9 / roofs.copy_gbps,
            "matmuls_ms_best": matmul_s and matmul_s * 1e3,
            "matmuls_fraction_of_matmul_peak": matmul_gflops and matmul_gflops / roofs.matmul_gflops,
            # issue #39 item 2: the work around the matmuls (norms, rotary, attention, residuals,
            # the per-layer Python path) as a share of the step, best against best
            "outside_matmuls_share": matmul_s and max(best_s - matmul_s, 0.0) / best_s,
        }
        if batch != 1 and "1" in out:   # median steps, as a multiple of the batch-1 step
            out[str(batch)]["step_over_batch1"] = step_s * 1e3 / out["1"]["step_ms"]
        if roofs.gpu is not None:
            out[str(batch)] |= gpu_roofs.fractions(roofs.gpu, dtype, gflops * 1e9, wbytes / best_s)
    return out
