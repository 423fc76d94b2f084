"""``mooncake bench model --tp N``: a decode step and a whole-prompt prefill split across N
tensor-parallel ranks (gloo on a CPU, NCCL on GPUs), beside the same at TP=1 in the same run, and
the share of each spent in the collectives (the two all-reduces per layer and the logits' gather).

Each rank is a process of its own (``torch.multiprocessing``), as in a TP instance. TP=1 runs twice:
with the threads of all N ranks together (the same cores), and with one rank's (the same threads
per process: on a machine other work keeps busy, N threads in one process can wait on each other
at every operator's barrier where N processes do not). A collective's time counts
from the call to its return on the rank timing it, so it includes waiting for the slowest rank
(skew), not only moving bytes; the bare all-reduce of one decode row and of a prefill's
activations, timed alone, is its floor.

A model with experts runs TP=N twice: each expert split by width over the ranks (what an
instance does) and whole experts placed per rank (expert parallelism), each with the expert
calls its busiest rank made in the last decode step and the prefill.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mooncake_kernels.timing import run_times
from mooncake_lite.model.args import DTYPES
from mooncake_lite.model.kv_cache import blocks_needed
from mooncake_lite.model.runner import ModelRunner
from mooncake_lite.model.tensor_parallel import TPLayout, build_sharded_model, check_divides
from mooncake_lite.common.ports import free_port
from mooncake_lite.model.tp_comms import GroupAddress, TPComms, backend_for
from mooncake_lite.model.weights import build_model, model_args

BLOCK_SIZE = 16


@dataclass(frozen=True)
class TPJob:
    spec: str
    size: int
    threads: int
    prompt_len: int
    context_len: int
    steps: int
    repeats: int
    dtype: str
    device: str
    pack: bool
    expert_parallel: bool = False


class TimedComms:
    """A group's collectives with the seconds spent in them added up (what the model sees)."""

    def __init__(self, comms: TPComms):
        self.comms, self.seconds = comms, 0.0

    def _timed(self, fn, x):
        t0 = time.perf_counter()
        out = fn(x)
        self.seconds += time.perf_counter() - t0
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._timed(self.comms.all_reduce, x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return self._timed(self.comms.gather_vocab, logits)


def _timed_share(fn, timed: TimedComms | None, device: str, repeats: int) -> dict:
    """Median seconds of ``fn`` and the median share of it spent in collectives."""
    shares, times = [], []
    fn()   # warm-up
    for _ in range(repeats):
        before = timed.seconds if timed else 0.0
        times += run_times(fn, device, 1)
        shares.append(((timed.seconds - before) if timed else 0.0) / times[-1])
    return {"ms": 1e3 * statistics.median(times), "ms_best": 1e3 * min(times),
            "collective_share": statistics.median(shares)}


def _measure(job: TPJob, model, timed: TimedComms | None) -> dict:
    runner = ModelRunner(model, num_blocks=blocks_needed(max(job.prompt_len, job.context_len + job.steps + 2),
                                                         BLOCK_SIZE), block_size=BLOCK_SIZE)
    tokens = [(7 * i) % runner.args.vocab_size for i in range(job.prompt_len)]
    table = list(range(runner.cache.num_blocks))
    prefill = _timed_share(lambda: runner.prefill(tokens, table, 0), timed, job.device, job.repeats)
    if job.pack:
        model.pack_()   # as a decode instance runs (CPU float32; elsewhere nothing changes)
    positions = iter(range(job.context_len, job.context_len + job.steps + 1))
    prefill["expert_calls"] = _expert_calls(model)   # the last of the timed prefills
    decode = _timed_share(lambda: runner.decode([11], [table], [next(positions)]), timed, job.device, job.steps)
    decode["expert_calls"] = _expert_calls(model)
    return {"prefill": prefill, "decode": decode}


def _expert_calls(model) -> int:
    """Expert MLPs this rank ran in its last pass, over all layers (``MoE.num_touched``)."""
    return sum(getattr(b.feed_forward, "num_touched", 0) for b in model.layers.values())


def _bare_all_reduce_ms(comms: TPComms, rows: int, dim: int, dtype: torch.dtype, device: str) -> float:
    x = torch.ones(rows, dim, dtype=dtype, device=device)
    return 1e3 * statistics.median(run_times(lambda: comms.all_reduce(x), device, 5, warmup=2))


def _head_ms(model, device: str) -> dict:
    """One decode row through the head as the ranks run it (its vocab rows, then the gather)
    against a replicated head's whole product (the embedding's matrix: the same shape) and no
    gather: why the head is split (docs/model.md, Tensor parallelism)."""
    h = torch.randn(1, model.args.dim, dtype=model.tok_embeddings.weight.dtype, device=device)
    whole = model.tok_embeddings.weight
    split = statistics.median(run_times(lambda: model.head(h), device, 20, warmup=3))
    replicated = statistics.median(run_times(lambda: torch.nn.functional.linear(model.norm(h), whole), device, 20,
                                             warmup=3))
    return {"vocab_parallel": 1e3 * split, "replicated": 1e3 * replicated}


def _rank_main(rank: int, job: TPJob, port: int, out: str) -> None:
    torch.set_num_threads(job.threads)
    devices = [job.device if job.device == "cpu" else f"{job.device}:{r % torch.cuda.device_count()}"
               for r in range(job.size)]
    device = devices[rank]
    dtype = DTYPES[job.dtype]
    if job.size == 1:
        result = _measure(job, build_model(job.spec, device=device, dtype=dtype), None)
    else:
        address = GroupAddress("127.0.0.1", port, job.size, backend=backend_for(devices))
        comms = TPComms(address, rank, device).join()
        try:
            timed = TimedComms(comms)
            layout = TPLayout(model_args(job.spec), job.size, rank, job.expert_parallel)
            with torch.inference_mode():
                model = build_sharded_model(job.spec, layout, timed, device=device, dtype=dtype)
                result = _measure(job, model, timed)
                result["head_ms"] = _head_ms(model, device) if layout.vocab_parallel else None
                dim = layout.args.dim
                result["bare_all_reduce_ms"] = {"decode_row": _bare_all_reduce_ms(comms, 1, dim, dtype, device),
                                                "prefill": _bare_all_reduce_ms(comms, job.prompt_len, dim, dtype, device)}
        finally:
            comms.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_degree(job: TPJob) -> list[dict]:
    """Each rank's figures for ``job`` (its ranks spawned and joined here)."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(job, free_port(), out), nprocs=job.size, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(job.size)]


def bench_tp(spec: str, size: int, *, threads: int | None, prompt_len: int, context_len: int, steps: int,
             repeats: int, dtype: str, device: str, pack: bool) -> dict:
    """One model at TP=1 and TP=``size`` on the same cores: step times, their ratio, and the
    collectives' share of TP=``size``'s steps (its slowest rank's)."""
    check_divides(model_args(spec), size)
    per_rank = threads or max(1, (os.cpu_count() or 1) // size)
    base = TPJob(spec, 1, per_rank * size, prompt_len, context_len, steps, repeats, dtype, device, pack)
    one = run_degree(base)[0]
    narrow = run_degree(TPJob(**(asdict(base) | {"threads": per_rank})))[0]
    ranks = run_degree(TPJob(**(asdict(base) | {"size": size, "threads": per_rank})))
    worst = _slowest(ranks)
    out = {"tp": size, "threads_per_rank": per_rank, "tp1": one, "tp1_rank_threads": narrow, f"tp{size}": worst,
           "speedup": {kind: one[kind]["ms"] / worst[kind]["ms"] for kind in ("prefill", "decode")},
           "bare_all_reduce_ms": ranks[0]["bare_all_reduce_ms"], "head_ms": ranks[0]["head_ms"], "ranks": ranks}
    if model_args(spec).moe is not None and model_args(spec).moe.num_experts % size == 0:
        placed = run_degree(TPJob(**(asdict(base) | {"size": size, "threads": per_rank, "expert_parallel": True})))
        out["placed"] = _slowest(placed)
    return out


def _slowest(ranks: list[dict]) -> dict:
    """Per kind, the slowest rank's figures, with the most expert calls any rank made."""
    out = {}
    for kind in ("prefill", "decode"):
        out[kind] = max(ranks, key=lambda r: r[kind]["ms"])[kind] | {
            "expert_calls": max(r[kind]["expert_calls"] for r in ranks)}
    return out


def render_tp(name: str, r: dict) -> list[str]:
    n = r["tp"]
    lines = [f"\n{name}: TP={n} ({r['threads_per_rank']} threads per rank) against TP=1 "
             f"({n * r['threads_per_rank']} threads)"]
    for kind in ("prefill", "decode"):
        one, many = r["tp1"][kind], r[f"tp{n}"][kind]
        lines.append(f"  {kind:7}: TP=1 {one['ms']:8.2f} ms  TP={n} {many['ms']:8.2f} ms  "
                     f"({r['speedup'][kind]:.2f}x)  collectives {100 * many['collective_share']:5.1f}% of the step; "
                     f"TP=1 on {r['threads_per_rank']} threads {r['tp1_rank_threads'][kind]['ms']:8.2f} ms")
    if "placed" in r:
        split, placed = r[f"tp{n}"], r["placed"]
        for kind in ("prefill", "decode"):
            lines.append(f"  experts at TP={n}, {kind}: split by width {split[kind]['ms']:8.2f} ms "
                         f"({split[kind]['expert_calls']} expert calls on the busiest rank), placed whole "
                         f"{placed[kind]['ms']:8.2f} ms ({placed[kind]['expert_calls']} calls): "
                         f"{placed[kind]['ms'] / split[kind]['ms']:.2f}x")
    bare = r["bare_all_reduce_ms"]
    lines.append(f"  a bare all-reduce: one row {bare['decode_row']:.3f} ms, a prefill's activations "
                 f"{bare['prefill']:.3f} ms")
    if r.get("head_ms"):
        lines.append(f"  the head on one row: vocab-parallel + gather {r['head_ms']['vocab_parallel']:.3f} ms, "
                     f"replicated {r['head_ms']['replicated']:.3f} ms")
    return lines
