"""``mooncake bench sim-scale``: the simulator at internet scale (issue #20 item 5).

Writes the synthetic trace ``mooncake trace synth -n N --rate R`` would write (16k-token
prompts, 512-token outputs, 50% reuse; or reads ``--trace``), then simulates it on P prefill +
D decode instances of a cost-model preset reading the file as it goes, with results summarized
as they end (``metrics.StreamingSummary``), so neither the trace nor the finished requests are
held. Reports the simulation's wall and CPU seconds, simulated requests per wall-second, and
the process's peak resident memory — which should not grow with N (compare two N).
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence

from mooncake_lite.bench.host import cpu_description
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.scheduler import SchedulerConfig
from mooncake_lite.sim.cluster import MooncakeSim
from mooncake_lite.sim.config import SimConfig
from mooncake_lite.sim.costs import get_hardware
from mooncake_lite.sim.metrics import StreamingSummary
from mooncake_lite.trace.format import iter_trace, write_trace
from mooncake_lite.trace.synth import SynthConfig, iter_synthesize

TARGET_S = 120.0          # issue #20: a million requests on 128P+128D within two minutes


FLAGS = (
    flag("-n", "--num-requests", type=int, default=1_000_000),
    flag("--rate", type=float, default=80.0, help="Poisson arrivals per second"),
    flag("--trace", default=None, help="simulate this trace (in time order) instead of a synthetic one"),
    flag("--prefill", type=int, default=128),
    flag("--decode", type=int, default=128),
    flag("--cost-model", default="llama2-70b-a800"),
    flag("--admission", default="early", choices=("none", "early", "predictive")),
    flag("--ttft-slo", type=float, default=30.0),
    flag("--tbt-slo", type=float, default=0.1),
    flag("--progress-every", type=int, default=50_000, metavar="N",
         help="print CPU seconds and resident memory to stderr every N ended requests (0: never)"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
    flag("--compiled", action="store_true",
         help="the simulator's hot modules compiled with mypyc (mooncake sim --compiled; docs/sim.md)"),
)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux


def _progress_every(step: int):
    """A progress callback printing, every ``step`` ended requests, the CPU seconds and the
    current resident memory so far to stderr (a long run shows its rate and that its memory
    stays flat before it ends)."""
    if step <= 0:
        return None
    start, mark = time.process_time(), [0]

    def progress(n: int) -> None:
        if n >= mark[0] + step:
            mark[0] = n - n % step
            with open("/proc/self/statm") as fh:
                rss_mb = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            sys.stderr.write(f"sim-scale: {n:,} requests ended, {time.process_time() - start:.1f} s CPU, "
                             f"RSS {rss_mb:.0f} MB\n")
            sys.stderr.flush()
    return progress


def simulate(path: str, args: Options) -> dict:
    """Simulate the trace at ``path`` streaming; the run's figures."""
    hw = get_hardware(args.cost_model)
    sched = SchedulerConfig(admission=args.admission, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                            block_size=hw.block_size)
    sim = MooncakeSim(SimConfig(num_prefill=args.prefill, num_decode=args.decode, hardware=args.cost_model,
                                scheduler=sched), hw)
    stream = StreamingSummary(args.ttft_slo, args.tbt_slo)
    sim.recorder.sink = stream.add
    rss_before = _peak_rss_mb()
    res = sim.run(iter_trace(path, block_size=hw.block_size), progress=_progress_every(args.progress_every))
    summary = stream.summarize(res)
    n = summary["num_requests"]
    return {"num_requests": n, "num_prefill": args.prefill, "num_decode": args.decode,
            "wall_s": round(res.wall_s, 1), "cpu_s": round(res.extra["cpu_s"], 1),
            "requests_per_wall_s": round(n / res.wall_s) if res.wall_s else None,
            "requests_per_cpu_s": round(n / res.extra["cpu_s"]) if res.extra["cpu_s"] else None,
            "peak_rss_mb_before_run": round(rss_before), "peak_rss_mb": round(_peak_rss_mb()),
            "load_average_1m": round(os.getloadavg()[0], 2), "num_cpus": os.cpu_count(), "cpu": cpu_description(),
            "target_s": TARGET_S, "summary": summary}


def main(argv: Sequence[str]) -> int:
    args = freeze(build_parser("mooncake bench sim-scale", __doc__.split("\n\n")[0], FLAGS).parse_args(list(argv)),
                  "SimScaleOptions")
    if args.compiled:
        from mooncake_lite.sim.compiled import run_on_build
        # re-executes on the build (or, in the re-executed process, checks that it runs there)
        if not run_on_build("mooncake bench sim-scale", ["bench", "sim-scale", *argv]):
            return 2
    figures: dict = {"compiled": args.compiled}
    with tempfile.TemporaryDirectory(prefix="sim-scale-") as tmp:
        path = args.trace
        if path is None:
            path = os.path.join(tmp, "trace.jsonl")
            t0 = time.perf_counter()
            write_trace(iter_synthesize(SynthConfig(num_requests=args.num_requests, rate_per_s=args.rate)), path)
            figures["synth_s"] = round(time.perf_counter() - t0, 1)
        figures.update(simulate(path, args))
    emit(figures, lambda f: render(f, args), as_json=args.json)
    return 0


def render(figures: dict, args: Options) -> str:
    s, ttft, tbt = figures["summary"], figures["summary"]["ttft_s"], figures["summary"]["tbt_s"]
    return "\n".join([
        f"sim-scale: {figures['num_requests']:,} requests on {args.prefill}P+{args.decode}D ({args.cost_model}, "
        f"admission {args.admission}); load average {figures['load_average_1m']} on {figures['cpu']}",
        f"  simulation: {figures['wall_s']} s wall, {figures['cpu_s']} s CPU — "
        f"{figures['requests_per_wall_s']:,} requests per wall-second "
        f"({figures['wall_s'] / TARGET_S * 1e6 / max(figures['num_requests'], 1):.2f}× the time a million "
        f"would have in {TARGET_S:.0f} s)",
        f"  peak RSS {figures['peak_rss_mb']} MB (before the run: {figures['peak_rss_mb_before_run']} MB)"
        + (f"; trace written in {figures['synth_s']} s" if "synth_s" in figures else ""),
        f"  completed {s['completed']:,}, rejected {s['rejected']:,}; TTFT mean {ttft['mean'] or 0:.2f} s "
        f"p90 {ttft['p90'] or 0:.2f} s; TBT mean {(tbt['mean'] or 0) * 1e3:.1f} ms p90 {(tbt['p90'] or 0) * 1e3:.1f} ms; "
        f"SLO attainment {s['slo_attainment']:.1%}; reused {s['reused_token_share']:.1%} of input tokens"])
