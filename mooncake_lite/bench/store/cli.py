"""``mooncake bench store``: store put/get GB/s and latency vs this machine's raw limits.

For each block size a real store process is started (``--slot-bytes`` = the block size) and
driven over loopback by this process: single put/get (one block per request, one in flight) and
batched put/get (many blocks per request, several requests in flight, gets received into
preallocated buffers), each over TCP and, interleaved with it, through the same-node fast path
(shared memory, ``shm_*``; ``shm_leased_get``: gets of blocks held under a match lease, read
from the slab without asking the store; ``put_alone``: single puts each after an idle gap, so
the store has finished with the one before, as a prefill's background write-back sees them).
Gets land in preallocated caller buffers (``out=``), as a client reading KV into its own tensors
does. In the same run it measures single-thread memcpy (one buffer onto another, cache-hot below
the last-level cache's size; and "cold", as the store's slab makes it: out of as many distinct
blocks as the gets read, into one reused buffer, and into successive blocks of a slab-sized
arena, what a put's copy into the slab is) and a plain blocking-socket loopback transfer
(``recv_into`` a preallocated buffer, two processes) with the same message sizes, and prints
every figure beside the Mooncake Store reference and the goals of issue 3. Medians over
``--repeat`` runs; ``--json`` prints everything as one JSON object.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import orjson

from mooncake_lite.bench.harness import role
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit, machine, machine_text
from mooncake_lite.bench.store.limits import memcpy_cold_gbps, memcpy_gbps, socket_gbps
from mooncake_lite.bench.store.measure import measure_store, working_blocks
from mooncake_lite.bench.store.summary import OPS, REFERENCE, SHM_OPS, summarize
from mooncake_lite.common.launch import RoleProcess, to_stderr
from mooncake_lite.common.units import format_size, parse_size

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
FLAGS = (
    flag("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes, e.g. 64KiB,1MiB"),
    flag("--repeat", type=int, default=3, help="runs per figure (the median is reported)"),
    flag("--bytes-per-run", type=parse_size, default=parse_size("256MiB"),
         help="bytes moved per measurement run (at least 16 operations)"),
    flag("--dram", type=parse_size, default=parse_size("512MiB"), help="store DRAM per size"),
    flag("--batch-bytes", type=parse_size, default=parse_size("16MiB"),
         help="bytes per batched request (at least one block)"),
    flag("--in-flight", type=int, default=4, help="batched requests in flight at once"),
    flag("--json", action="store_true", help="print all figures as one JSON object"),
    flag("--link", action="append", metavar="RATE",
         help="between two nodes over a link shaped to RATE (e.g. 1gbit; repeat for more rates), "
              "beside loopback: GB/s and the link's share used (needs root; bench/link/store.py)"),
    flag("--link-bytes", type=parse_size, default=parse_size("64MiB"), help="with --link: bytes moved per op and path"),
)


def parse_args(argv: Sequence[str]) -> Options:
    return freeze(build_parser("mooncake bench store", __doc__.split("\n\n")[0], FLAGS).parse_args(list(argv)),
                  "StoreOptions")


# ---- the store under test ------------------------------------------------------------------------
@contextmanager
def store_for(size: int, dram: int, staging: int) -> Iterator[RoleProcess]:
    """A store of ``size``-byte slots, its slab resident, while the block runs."""
    with role("store", "--port", "0", "--data-port", "0", "--dram", str(dram), "--slot-bytes", str(size),
              "--shm-staging", str(staging), "--log-level", "warning", on_line=to_stderr, stop_timeout=30) as store:
        wait_resident(store.addresses["http"])
        yield store


def wait_resident(http: str, limit_s: float = 300.0) -> None:
    """Until every slab page is faulted in (a big slab is populated in the background after
    start): what a long-running store's puts see, not its first minute's page faults."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{http}/health", timeout=10) as resp:
            if orjson.loads(resp.read()).get("dram_resident", True):
                return
        time.sleep(0.1)
    raise RuntimeError(f"the store's slab was not resident after {limit_s:g} s")


def bench_size(size: int, args: Options) -> dict:
    """Rounds alternate raw limits and store figures, so load changes hit both alike."""
    import uvloop
    from mooncake_lite.bench.store import floor as store_floor
    raw: dict[str, list[float]] = {"memcpy": [], "memcpy_cold_read": [], "memcpy_cold_write": [], "socket": [],
                                   "socket_cpu": [], "socket_arena": []}
    floors: list[dict[str, float]] = []
    rounds: list[dict] = []
    dram = max(args.dram, 64 * size)
    with store_for(size, dram, staging=2 * max(1, args.in_flight) * max(args.batch_bytes, size)) as store:
        for _ in range(args.repeat):
            raw["memcpy"].append(memcpy_gbps(size, args.bytes_per_run))
            cold = memcpy_cold_gbps(size, args.bytes_per_run, min(dram, 512 << 20), working_blocks(dram // size))
            raw["memcpy_cold_read"].append(cold[0])
            raw["memcpy_cold_write"].append(cold[1])
            gbps, cpu = socket_gbps(size, args.bytes_per_run)
            raw["socket"].append(gbps)
            raw["socket_cpu"].append(cpu)
            raw["socket_arena"].append(socket_gbps(size, args.bytes_per_run, min(dram, 512 << 20))[0])
            rounds.append(uvloop.run(measure_store(store.addresses["data"], store.pid, size, args, dram // size)))
            floors.append(store_floor.measure(store.addresses["data"]))
    out = summarize(size, raw, rounds)
    out["round_trip_us"] = {name: statistics.median(f[name] for f in floors) for name in floors[0]}
    return out


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeat < 1 or not sizes or any(s < 64 for s in sizes):
        sys.stderr.write("mooncake bench store: --repeat must be >= 1 and sizes >= 64 bytes\n")
        return 2
    if args.link:
        from mooncake_lite.bench.link import store as link_store
        return link_store.store_main(sizes, args)
    emit(measure(sizes, args), render, as_json=args.json)
    return 0


def measure(sizes: Sequence[int], args: Options) -> dict:
    """Every figure of every block size, with the machine and the reference, as one dict."""
    load = os.getloadavg()[0]
    report: dict = {"repeat": args.repeat, "sizes": {}, "reference_mooncake_gbps": REFERENCE}
    for size in sizes:
        if not args.json:
            print(f"measuring {size} B blocks ...", file=sys.stderr, flush=True)
        report["sizes"][str(size)] = bench_size(size, args)
    report["machine"] = machine(load)
    return report



def render(report: dict) -> str:
    lines = [f"mooncake bench store: {machine_text(report['machine'])}, "
             f"median of {report['repeat']} runs, GB/s = 1e9 B/s"]
    for size, r in report["sizes"].items():
        c = r["config"]
        lines.append(f"\n{format_size(int(size))} blocks: memcpy {r['memcpy_gbps']:.2f} GB/s (best round; median "
                     f"{r['memcpy_median_gbps']:.2f}; cold: out of the "
                     f"get's blocks {r['memcpy_cold_read_gbps']:.2f}, into a slab-sized arena "
                     f"{r['memcpy_cold_write_gbps']:.2f}), blocking socket "
                     f"{r['socket_gbps']:.2f} GB/s ({r['socket_cpu_s_per_gb']:.2f} CPU s/GB), into a slab-sized arena "
                     f"{r['socket_arena_gbps']:.2f} GB/s; batched = {c['blocks_per_request']} blocks/request, "
                     f"{c['in_flight']} in flight")
        if r.get("invalid_rounds"):
            lines.append(f"  INVALID rounds {r['invalid_rounds']}: cache-hot memcpy below the cold read "
                         f"(a disturbed reference; the goals are judged against the best round)")
        if "round_trip_us" in r:
            f = r["round_trip_us"]
            lines.append(f"  round trip p50 (the floor of a single request): uvloop echo {f['unix_echo']:.0f} us "
                         f"(Unix socket), {f['tcp_echo']:.0f} us (TCP); a store request with no work "
                         f"{f['store_request']:.0f} us")
        lines.append(f"  {'op':<16} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8} {'x socket':>9} {'x arena':>8} "
                     f"{'x memcpy':>8} {'x cold':>6} {'x tcp':>6} {'CPU s/GB':>9} {'Mooncake':>11} {'x Mooncake':>10}  goals")
        for op in (o for o in OPS + SHM_OPS if o in r):
            e = r[op]
            xtcp = f"{e['vs_tcp']:.2f}" if "vs_tcp" in e else "-"
            ref = "-".join(f"{x:.2f}" for x in e.get("mooncake_gbps", [])) or "-"
            vs = f"{e['vs_mooncake_high']:.2f}" if "vs_mooncake_high" in e else "-"
            goals = " ".join(f"{k}:{'ok' if v else 'MISS'}" for k, v in e["goals_met"].items())
            lines.append(f"  {op:<16} {e['gbps']:>6.2f} {e['p50_ms']:>8.3f} {e['p99_ms']:>8.3f} {e['vs_socket']:>9.2f} "
                         f"{e['vs_socket_arena']:>8.2f} {e['vs_memcpy']:>8.2f} {e['vs_memcpy_cold']:>6.2f} {xtcp:>6} "
                         f"{e['cpu_s_per_gb']:>9.2f} "
                         f"{ref:>11} {vs:>10}  {goals}")
    return "\n".join(lines)
