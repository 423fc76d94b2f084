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

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence

import orjson

from mooncake_lite.bench.store.limits import (memcpy_cold_gbps, memcpy_gbps, process_cpu, socket_gbps,
                                              socket_sender)
from mooncake_lite.common.launch import RoleProcess, to_stderr
from mooncake_lite.common.units import format_size, parse_size

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mooncake bench store", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes, e.g. 64KiB,1MiB")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (the median is reported)")
    p.add_argument("--bytes-per-run", type=parse_size, default=parse_size("256MiB"),
                   help="bytes moved per measurement run (at least 16 operations)")
    p.add_argument("--dram", type=parse_size, default=parse_size("512MiB"), help="store DRAM per size")
    p.add_argument("--batch-bytes", type=parse_size, default=parse_size("16MiB"),
                   help="bytes per batched request (at least one block)")
    p.add_argument("--in-flight", type=int, default=4, help="batched requests in flight at once")
    p.add_argument("--json", action="store_true", help="print all figures as one JSON object")
    p.add_argument("--link", action="append", metavar="RATE",
                   help="between two nodes over a link shaped to RATE (e.g. 1gbit; repeat for more rates), "
                        "beside loopback: GB/s and the link's share used (needs root; bench/link_store.py)")
    p.add_argument("--link-bytes", type=parse_size, default=parse_size("64MiB"),
                   help="with --link: bytes moved per op and path")
    p.add_argument("--socket-sender", nargs=3, metavar=("HOSTPORT", "SIZE", "COUNT"), help=argparse.SUPPRESS)
    return p.parse_args(list(argv))


# ---- the store under test ------------------------------------------------------------------------
def start_store(size: int, dram: int, staging: int) -> RoleProcess:
    store = RoleProcess.start("store", "--port", "0", "--data-port", "0", "--dram", str(dram),
                              "--slot-bytes", str(size), "--shm-staging", str(staging), "--log-level", "warning",
                              timeout=None, on_line=to_stderr)
    wait_resident(store.addresses["http"])
    return store


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


async def measure_store(address: str, server_pid: int, size: int, args: argparse.Namespace,
                        num_slots: int) -> dict[str, tuple]:
    """One round of the four store figures: op -> (GB/s, latencies, CPU s/GB of client + store)."""
    from mooncake_lite.store.client import StoreClient
    tcp = await StoreClient.connect(address, name="bench", max_batch_bytes=1 << 40, max_batch_keys=1 << 20, shm=False)
    fast = await StoreClient.connect(address, name="bench", max_batch_bytes=1 << 40, max_batch_keys=1 << 20)
    block = memoryview(bytearray(os.urandom(64)) * (size // 64) + os.urandom(size % 64))
    count = max(16, args.bytes_per_run // size)
    per_batch = max(1, args.batch_bytes // size)
    in_flight = max(1, min(args.in_flight, (num_slots // 2) // per_batch))
    working = [os.urandom(16) for _ in range(working_blocks(num_slots))]
    outs = [memoryview(bytearray(size)) for _ in range(per_batch * in_flight)]
    for out in outs:
        out[:] = block   # resident, as a client's preallocated tensors are

    def fresh_keys(n: int) -> list[bytes]:
        return [os.urandom(16) for _ in range(n)]

    async def single(client: StoreClient, op: str, lat: list[float]) -> int:
        for i in range(count):
            t = time.perf_counter()
            if op == "put":
                await client.put(fresh_keys(1), [block])
            elif (await client.get([working[i % len(working)]], out=outs[:1]))[0] is None:   # into the caller's buffer
                raise RuntimeError("bench bug: a get missed (the working set was evicted)")
            lat.append(time.perf_counter() - t)
        return count * size

    async def alone(client: StoreClient, op: str, lat: list[float]) -> int:
        # A few puts, each after a gap: the store's copy of the one before (staged puts are
        # answered before it) is over, so each costs what a lone put costs.
        num = min(count, ALONE_PUTS)
        for _ in range(num):
            await asyncio.sleep(ALONE_GAP_S)
            t = time.perf_counter()
            await client.put(fresh_keys(1), [block])
            lat.append(time.perf_counter() - t)
        return num * size

    async def leased(client: StoreClient, op: str, lat: list[float]) -> int:
        num, lease = await client.match_and_pin(working, lease_s=60)
        if num != len(working):
            raise RuntimeError("bench bug: the working set is not all in the store")
        try:
            return await single(client, op, lat)
        finally:
            await client.release(lease)

    async def batched(client: StoreClient, op: str, lat: list[float]) -> int:
        num_requests = max(in_flight * 2, count // per_batch)

        async def worker(w: int) -> None:
            for r in range(w, num_requests, in_flight):
                t = time.perf_counter()
                if op == "put":
                    await client.put(fresh_keys(per_batch), [block] * per_batch)
                else:
                    keys = [working[(r * per_batch + j) % len(working)] for j in range(per_batch)]
                    got = await client.get(keys, out=outs[w * per_batch:(w + 1) * per_batch])
                    if any(g is None for g in got):
                        raise RuntimeError("bench bug: a get missed (the working set was evicted)")
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker(w) for w in range(in_flight)))
        return num_requests * per_batch * size

    if fast.shm is not None and fast.shm.staging is not None:
        # A connection's staging area is allocated as it is first written: pay that once, untimed.
        await batched(fast, "put", [])
    results: dict[str, tuple] = {}
    # Each op over TCP and then through shared memory, back to back: load swings hit both alike.
    plan = [(name, fn, op, client) for name, fn, op in (("put", single, "put"), ("put_alone", alone, "put"),
                                                        ("get", single, "get"),
                                                        ("batched_put", batched, "put"), ("batched_get", batched, "get"))
            for client in ((tcp, fast) if fast.transport == "shm" else (tcp,))]
    if fast.transport == "shm":
        plan.append(("leased_get", leased, "get", fast))
    for name, fn, op, client in plan:
        if op == "get":
            await client.put(working, [block] * len(working))  # the puts before may have evicted it
        lat: list[float] = []
        cpu0, server0, start = time.process_time(), process_cpu(server_pid), time.perf_counter()
        nbytes = await fn(client, op, lat)
        # A lone put's rate is over its own time, not the idle gaps between them.
        elapsed = sum(lat) if fn is alone else time.perf_counter() - start
        cpu = time.process_time() - cpu0 + process_cpu(server_pid) - server0
        results[("shm_" if client is fast else "") + name] = (nbytes / elapsed / 1e9, lat, cpu / (nbytes / 1e9))
    await tcp.close()
    await fast.close()
    results["config"] = ({"blocks_per_request": per_batch, "in_flight": in_flight, "ops_per_run": count},)
    return results


def working_blocks(num_slots: int) -> int:
    """The distinct blocks the gets read, over and over (half the store's slots at most)."""
    return min(num_slots // 2, 64)


def bench_size(size: int, args: argparse.Namespace) -> dict:
    """Rounds alternate raw limits and store figures, so load changes hit both alike."""
    import uvloop
    from mooncake_lite.bench.store import floor as store_floor
    raw: dict[str, list[float]] = {"memcpy": [], "memcpy_cold_read": [], "memcpy_cold_write": [], "socket": [],
                                   "socket_cpu": [], "socket_arena": []}
    floors: list[dict[str, float]] = []
    rounds: list[dict] = []
    dram = max(args.dram, 64 * size)
    store = start_store(size, dram, staging=2 * max(1, args.in_flight) * max(args.batch_bytes, size))
    try:
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
    finally:
        store.stop(30)
    out = summarize(size, raw, rounds)
    out["round_trip_us"] = {name: statistics.median(f[name] for f in floors) for name in floors[0]}
    return out


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.socket_sender:
        hostport, size, count = args.socket_sender
        return socket_sender(hostport, int(size), int(count))
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.repeat < 1 or not sizes or any(s < 64 for s in sizes):
        sys.stderr.write("mooncake bench store: --repeat must be >= 1 and sizes >= 64 bytes\n")
        return 2
    if args.link:
        from mooncake_lite.bench.link import store as link_store
        return link_store.store_main(sizes, args)
    report = measure(sizes, args)
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
    else:
        print(render(report))
    return 0


def measure(sizes: Sequence[int], args: argparse.Namespace) -> dict:
    """Every figure of every block size, with the machine and the reference, as one dict."""
    report = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
              "repeat": args.repeat, "sizes": {}, "reference_mooncake_gbps": REFERENCE}
    for size in sizes:
        if not args.json:
            print(f"measuring {size} B blocks ...", file=sys.stderr, flush=True)
        report["sizes"][str(size)] = bench_size(size, args)
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    return report


# ---- report ----------------------------------------------------------------------------------
# Real Mooncake Store 0.3.13 on this kind of machine (issue 3), GB/s, (low, high) of two runs.
REFERENCE = {
    "put": {65536: (0.18, 0.20), 1048576: (1.31, 1.42), 4194304: (1.57, 1.85), 16777216: (1.55, 1.67)},
    "get": {65536: (0.26, 0.29), 1048576: (0.73, 1.10), 4194304: (0.85, 1.82), 16777216: (1.57, 1.86)},
    "batched_put": {65536: (0.79, 1.01), 1048576: (1.52, 2.10), 4194304: (2.08, 2.19), 16777216: (2.34, 2.40)},
    "batched_get": {65536: (1.17, 1.20), 1048576: (1.88, 2.30), 4194304: (1.81, 1.92), 16777216: (2.16, 2.22)},
}
OPS = ("put", "put_alone", "get", "batched_put", "batched_get")
SHM_OPS = ("shm_put", "shm_put_alone", "shm_get", "shm_batched_put", "shm_batched_get", "shm_leased_get")
ALONE_PUTS, ALONE_GAP_S = 32, 0.005   # put_alone: puts per round, idle seconds before each


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def memcpy_reference(raw: dict[str, list[float]]) -> dict:
    """The cache-hot memcpy the 50% goal is judged against: the best round (each round already
    best of ``store_limits.MEMCPY_PASSES`` passes), so a round another process slowed cannot lower the bar. A round
    whose cache-hot memcpy measured below its cold read was plainly disturbed: it is listed in
    ``invalid_rounds`` (and the table says so), whatever it measured."""
    hot, cold = raw["memcpy"], raw["memcpy_cold_read"]
    return {"memcpy_gbps": max(hot), "memcpy_median_gbps": statistics.median(hot), "memcpy_runs": hot,
            "invalid_rounds": [i for i, (h, c) in enumerate(zip(hot, cold)) if h < c]}


def summarize(size: int, raw: dict[str, list[float]], rounds: list[dict]) -> dict:
    out: dict = {**memcpy_reference(raw),
                 "memcpy_cold_read_gbps": statistics.median(raw["memcpy_cold_read"]),
                 "memcpy_cold_write_gbps": statistics.median(raw["memcpy_cold_write"]),
                 "socket_gbps": statistics.median(raw["socket"]), "socket_runs": raw["socket"],
                 "socket_cpu_s_per_gb": statistics.median(raw["socket_cpu"]),
                 "socket_arena_gbps": statistics.median(raw["socket_arena"]), "socket_arena_runs": raw["socket_arena"],
                 "config": rounds[0]["config"][0]}
    for op in OPS + SHM_OPS:
        if op not in rounds[0]:
            continue   # no same-node fast path here
        rates = [r[op][0] for r in rounds]
        lat = [x for r in rounds for x in r[op][1]]
        gbps = statistics.median(rates)
        ref = REFERENCE.get(op, {}).get(size)
        entry = {"gbps": gbps, "runs": rates, "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
                 "cpu_s_per_gb": statistics.median(r[op][2] for r in rounds),
                 "vs_socket": gbps / out["socket_gbps"], "vs_socket_arena": gbps / out["socket_arena_gbps"],
                 "vs_memcpy": gbps / out["memcpy_gbps"],
                 # against the same copy out of (gets) or into (puts) memory as cold as the slab
                 "vs_memcpy_cold": gbps / out["memcpy_cold_read_gbps" if "get" in op else "memcpy_cold_write_gbps"]}
        goals = {}
        if op in SHM_OPS:
            out[op] = entry
            entry["goals_met"] = _shm_goals(op, size, entry, out)
            continue
        if op == "put_alone":   # the TCP peer of shm_put_alone; no goal of its own
            entry["goals_met"] = {}
            out[op] = entry
            continue
        if ref:
            entry["mooncake_gbps"] = list(ref)
            entry["vs_mooncake_high"] = gbps / ref[1]
            goals["1.5x_mooncake"] = gbps >= 1.5 * ref[1]
        if size >= 1 << 20:
            goals["85pct_socket"] = gbps >= 0.85 * out["socket_gbps"]
        if size == 64 << 10 and op.startswith("batched"):
            goals["2GBps_at_64KiB"] = gbps >= 2.0
        entry["goals_met"] = goals
        out[op] = entry
    return out


def _shm_goals(op: str, size: int, entry: dict, out: dict) -> dict[str, bool]:
    """Issue 17: >= 50% of the best cache-hot memcpy at >= 1 MiB, a 64 KiB get in <= 50 us, >= 2x TCP everywhere."""
    tcp = out["get" if op == "shm_leased_get" else op.removeprefix("shm_")]
    entry["vs_tcp"] = entry["gbps"] / tcp["gbps"]
    goals = {"2x_tcp": entry["vs_tcp"] >= 2.0}
    if size >= 1 << 20:   # leased gets too (no round trip, but the "get"), on their own row
        goals["50pct_memcpy"] = entry["vs_memcpy"] >= 0.5
    # vs_memcpy_cold (the "x cold" column) is a reference only: the goal is the
    # cache-hot single-thread memcpy, and the cold copy, slower by construction, is no goal.
    if size == 64 << 10 and op in ("shm_get", "shm_leased_get"):
        goals["64KiB_get_50us"] = entry["p50_ms"] <= 0.05
    return goals


def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"mooncake bench store: {m['cpus']} CPUs, load {m['load_avg_1m']:.2f} -> {m['load_avg_1m_end']:.2f}, "
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

