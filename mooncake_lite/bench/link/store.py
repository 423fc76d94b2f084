"""``mooncake bench store --link RATE`` (issue #16 item 7; the shared measuring in ``measure.py``).

store: a store on node1, the client on node2: batched puts then batched gets of ``--link-bytes``
per op, and a plain blocking-socket stream of the same bytes (the link's ceiling for one TCP
connection from Python). Beside them, in the same run, the same client on node1 itself (its
traffic to node1's address goes over ``lo``): loopback.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence

from mooncake_lite.bench.link.measure import (PAYLOAD_PER_FRAME, SHARE_GOAL, SINK_PORT, Wire, refused, run_worker,
                                              share, sink_on, socket_stream)
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.report import machine, machine_text, run_and_emit
from mooncake_lite.cluster import netns
from mooncake_lite.cluster.netns import Link, NetnsError, Nodes
from mooncake_lite.common.launch import LAUNCHER, to_stderr
from mooncake_lite.common.units import format_size


async def store_client(spec: dict) -> dict:
    """Batched puts of fresh keys, then batched gets of a resident working set, over TCP."""
    from mooncake_lite.store.client import StoreClient
    size, count = spec["size"], spec["count"]
    per_batch = max(1, min(count, spec["batch_bytes"] // size))
    requests = [min(per_batch, count - i) for i in range(0, count, per_batch)]
    in_flight = max(1, min(spec["in_flight"], len(requests), spec["slots"] // 4 // per_batch or 1))
    client = await StoreClient.connect(spec["address"], name="bench-link", max_batch_bytes=1 << 40,
                                       max_batch_keys=1 << 20, shm=False)
    block = memoryview(bytearray(os.urandom(64)) * (size // 64) + os.urandom(size % 64))
    working = [os.urandom(16) for _ in range(min(per_batch * in_flight, spec["slots"] // 2))]
    outs = [memoryview(bytearray(size)) for _ in range(per_batch * in_flight)]
    moved = {"put": 0, "get": 0}

    async def worker(op: str, w: int) -> None:
        for r in range(w, len(requests), in_flight):
            n = requests[r]
            if op == "put":
                await client.put([os.urandom(16) for _ in range(n)], [block] * n)
                moved["put"] += n * size
                continue
            keys = [working[(r * per_batch + j) % len(working)] for j in range(n)]
            got = await client.get(keys, out=outs[w * per_batch:w * per_batch + n])
            if any(g is None for g in got):
                raise RuntimeError("bench bug: a get missed (the working set was evicted)")
            moved["get"] += sum(g.nbytes for g in got)

    out = {"config": {"blocks_per_request": per_batch, "in_flight": in_flight, "blocks": count}}
    for op, wire in (("put", spec["wire_out"]), ("get", spec["wire_in"])):
        if op == "get":
            await client.put(working, [block] * len(working))   # untimed: the puts evicted it
        meter, t0 = Wire(wire), time.perf_counter()
        await asyncio.gather(*(worker(op, w) for w in range(in_flight)))
        out[op] = meter.done({"bytes": moved[op], "seconds": time.perf_counter() - t0})
    await client.close()
    host = spec["address"].rsplit(":", 1)[0]
    out["socket"] = socket_stream(host, spec["sink_port"], size, count, spec["wire_out"])
    return out


# ---- bench store --link --------------------------------------------------------------------------
STORE_OPS = ("socket", "put", "get")


def store_main(sizes: Sequence[int], args: Options) -> int:
    """``mooncake bench store --link RATE [--link RATE ...]``."""
    links = refused("mooncake bench store", args.link)
    if links is None:
        return 2
    return run_and_emit("mooncake bench store", lambda: run_store(sizes, links, args), render_store,
                        as_json=args.json, errors=(NetnsError,))


def run_store(sizes: Sequence[int], links: Sequence[Link], args: Options) -> dict:
    """Per size: a store on node1; per repeat, the client on node2 at each rate, then on node1."""
    load = os.getloadavg()[0]
    report: dict = {"repeat": args.repeat, "links": [str(link) for link in links], "bytes_per_op": args.link_bytes, "sizes": {}}
    with Nodes.create(2, links[0]) as nodes:
        server, client = nodes[0], nodes[1]
        report["nodes"] = {"store": server.address, "client": client.address}
        hub = nodes.hub
        paths = {"wire_out": [(client.netns, client.device), (hub, "n1")],     # client -> store
                 "wire_in": [(server.netns, server.device), (hub, "n2")]}      # store -> client
        with sink_on(server):
            for size in sizes:
                if not args.json:
                    print(f"measuring {format_size(size)} blocks ...", file=sys.stderr, flush=True)
                report["sizes"][str(size)] = _store_size(nodes, size, links, paths, args)
    report["machine"] = machine(load)
    return report


def _store_size(nodes: Nodes, size: int, links: Sequence[Link], paths: dict, args: Options) -> dict:
    server, client = nodes[0], nodes[1]
    count = max(1, args.link_bytes // size)
    dram = max(256 << 20, 32 * size)
    store = nodes.start(server, f"store-{size}", [*LAUNCHER, "--role", "store", "--host", server.address,
                                                  "--port", "0", "--data-port", "0", "--dram", str(dram),
                                                  "--slot-bytes", str(size), "--log-level", "warning"],
                        on_line=to_stderr)
    spec = {"address": store.addresses["data"], "size": size, "count": count, "batch_bytes": args.batch_bytes,
            "in_flight": args.in_flight, "slots": dram // size, "sink_port": SINK_PORT}
    runs: dict[str, list[dict]] = {str(link): [] for link in links} | {"loopback": []}
    # generous: the whole op at a tenth of the slowest rate
    timeout = 60 + 3 * count * size * 8 * 10 / min(link.rate_bps for link in links)
    try:
        for _ in range(args.repeat):
            for link in links:
                netns.reshape(nodes.shaped_devices(), link)
                runs[str(link)].append(run_worker(client, "store-client", {**spec, **paths}, timeout))
            runs["loopback"].append(run_worker(server, "store-client", {**spec, "wire_out": [], "wire_in": []},
                                               timeout))
    finally:
        store.stop(30)
    return _summarize_store(size, count, links, runs)


def _summarize_store(size: int, count: int, links: Sequence[Link], runs: dict[str, list[dict]]) -> dict:
    """Median GB/s per op and path; share and wire share of each rate; x loopback."""
    out: dict = {"bytes_asked": count * size, "config": runs["loopback"][0]["config"]}
    for path, rounds in runs.items():
        link = next((lk for lk in links if str(lk) == path), None)
        entry = {}
        for op in STORE_OPS:
            rows = [r[op] for r in rounds]
            gbps = [r["bytes"] / r["seconds"] / 1e9 for r in rows]
            best = rows[gbps.index(statistics.median_high(gbps))]
            e = {"gbps": statistics.median(gbps), "runs": gbps, "bytes_moved": best["bytes"],
                 "all_bytes_moved": all(r["bytes"] == count * size for r in rows)}
            if link is not None:
                shares = [share(r["bytes"], link.rate_bps, r["seconds"]) for r in rows]
                e["link_share"] = statistics.median(shares)
                e["wire_share"] = statistics.median(share(r["wire_bytes"], link.rate_bps, r["seconds"]) for r in rows)
                e["wire_over_payload"] = statistics.median(r["wire_bytes"] / r["bytes"] for r in rows)
                e["drops"] = sum(r["drops"] for r in rows)
                e["goal_90pct"] = e["link_share"] >= SHARE_GOAL
            entry[op] = e
        out[path] = entry
    for path in out:
        if path in runs and path != "loopback":
            for op in STORE_OPS:
                out[path][op]["loopback_over_link"] = out["loopback"][op]["gbps"] / out[path][op]["gbps"]
    return out


def render_store(report: dict) -> str:
    n = report["nodes"]
    lines = [f"mooncake bench store --link: store on node1 ({n['store']}), client on node2 ({n['client']}) over "
             f"{' / '.join(report['links'])}; loopback = the same client on node1",
             f"{machine_text(report['machine'])}; median of "
             f"{report['repeat']} runs of {format_size(report['bytes_per_op'])} per op; GB/s = 1e9 B/s",
             f"share = payload / (rate x time) (ceiling 1448/1514 = {PAYLOAD_PER_FRAME:.1%} at MTU 1500); "
             "wire = bytes the link's qdisc sent / (rate x time); "
             "socket = one blocking-socket stream of the same bytes"]
    for size, r in report["sizes"].items():
        c = r["config"]
        lines.append(f"\n{format_size(int(size))} blocks ({c['blocks_per_request']} a request, {c['in_flight']} in "
                     f"flight, {format_size(r['bytes_asked'])} per op)")
        lines.append(f"  {'path':<10} {'op':<7} {'GB/s':>7} {'share':>6} {'wire':>6} {'drops':>6} "
                     f"{'x loopback':>10}  goal")
        for path, entry in ((p, e) for p, e in r.items() if p not in ("bytes_asked", "config")):
            for op in STORE_OPS:
                e = entry[op]
                if "link_share" in e:
                    tail = (f"{e['link_share']:>6.1%} {e['wire_share']:>6.1%} {e['drops']:>6} "
                            f"{1 / e['loopback_over_link']:>10.3f}  {'>=90%:ok' if e['goal_90pct'] else '>=90%:MISS'}")
                else:
                    tail = f"{'-':>6} {'-':>6} {'-':>6} {1.0:>10.3f}"
                lines.append(f"  {path:<10} {op:<7} {e['gbps']:>7.3f} {tail}"
                             + ("" if e["all_bytes_moved"] else "  BYTES MISSING"))
    return "\n".join(lines)
