"""``mooncake bench pd --link RATE`` (issue #16 item 7; the shared measuring in ``measure.py``).

pd: a decode on node2, the prefill (the role's StageEngine, as ``bench pd`` (a) runs it) in a
worker on node1. Per repeat, interleaved: compute only (KV dropped: the compute time alone), and
per link compute-then-send (the whole KV sent after the last layer: its tail is the stream's own
time on the link; its compute phase counts as compute alone too) and layer-wise streaming (the
role's path: the end-to-end time over the link), then a plain socket stream of the same bytes.
Hidden share = 1 - (end-to-end - compute alone) / (KV bytes x 8 / rate): the share of the pure
transfer time at the link rate that layer-wise streaming hides (goal >= 0.8: end-to-end exceeds
compute by at most 20% of the transfer time).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mooncake_lite.bench.link.measure import (HIDDEN_GOAL, PAYLOAD_PER_FRAME, SHARE_GOAL, SINK_PORT, Wire, refused,
                                              run_worker, share, sink_on, socket_stream)
from mooncake_lite.bench.options import Options
from mooncake_lite.bench.report import machine, machine_text, run_and_emit
from mooncake_lite.cluster import netns
from mooncake_lite.cluster.netns import Link, NetnsError, Nodes
from mooncake_lite.common.launch import LAUNCHER, to_stderr

# ---- bench pd --link -----------------------------------------------------------------------------
KV_TARGET_BYTES = 40_000_000      # a default prompt's KV: tens of MB, ~0.3 s at 1 Gbit


def link_prompt_len(name: str) -> int:
    """Tokens whose float32 KV is about KV_TARGET_BYTES (whole blocks), within the model's context."""
    from mooncake_lite.bench.pd.roles import BLOCK
    from mooncake_lite.model.weights import model_args
    args = model_args(name)
    n = math.ceil(KV_TARGET_BYTES / args.kv_bytes_per_token("float32") / BLOCK) * BLOCK
    return min(n, args.max_seq_len // BLOCK * BLOCK)


def pd_main(a: Options) -> int:
    """``mooncake bench pd --link RATE [...]`` (``a``: bench pd's options)."""
    links = refused("mooncake bench pd", a.link)
    if links is None:
        return 2
    return run_and_emit("mooncake bench pd", lambda: measure_pd(links, a), render_pd, as_json=a.json,
                        errors=(NetnsError, ValueError, FileNotFoundError))


def measure_pd(links: Sequence[Link], a: Options) -> dict:
    from mooncake_lite.model.source import DEFAULT_MODEL
    models = [DEFAULT_MODEL] if a.default_models else a.models   # the real default model alone
    load = os.getloadavg()[0]
    res: dict = {"links": [str(x) for x in links], "repeats": a.repeats, "models": {}}
    for name in models:
        n = link_prompt_len(name) if a.prompt_len is None else a.prompt_lens[name]
        res["models"][name] = run_pd(name, n, links, a)
    res["machine"] = machine(load)
    return res


def run_pd(name: str, n: int, links: Sequence[Link], a: Options) -> dict:
    """A decode on node2, the prefill worker on node1; the worker measures and re-shapes."""
    from mooncake_lite.bench.pd.roles import BLOCK
    with Nodes.create(2, links[0]) as nodes:
        prefill_node, decode_node = nodes[0], nodes[1]
        decode = nodes.start(decode_node, "decode", [
            *LAUNCHER, "--role", "decode", "--host", decode_node.address, "--port", "0", "--model", name,
            "--block-size", str(BLOCK), "--no-profile", "--num-blocks", str(2 * (n // BLOCK + 2)),
            "--threads", str(max(1, a.threads // 2)), "--log-level", "warning"], timeout=300, on_line=to_stderr)
        spec = {"model": name, "prompt_len": n, "chunk": a.chunk, "repeats": a.repeats,
                "threads": max(1, a.threads // 2), "decode_http": decode.url(), "decode_pid": decode.pid,
                "decode_data": decode.addresses["data"],
                "links": [str(x) for x in links], "shaped": nodes.shaped_devices(),
                "wire": [(prefill_node.netns, prefill_node.device), (nodes.hub, "n2")],
                "nodes": {"prefill": prefill_node.address, "decode": decode_node.address}}
        with sink_on(decode_node):
            out = run_worker(prefill_node, "pd", spec, timeout=3600)
    return summarize_pd(out, links)


@dataclass(frozen=True)
class _Decode:
    """What ``bench.pd.announce`` needs of a decode: its HTTP URL."""

    http: str

    def url(self, key: str = "http") -> str:
        return self.http


async def pd_worker(spec: dict) -> dict:
    """On the prefill's node: the StageEngine of ``bench pd`` (a), its KV to decode over the link."""
    import aiohttp
    import torch
    torch.set_num_threads(spec["threads"])
    async with aiohttp.ClientSession() as session:
        rig = LinkPrefill(spec, session)
        rows: dict[str, list[dict]] = {"compute_only": []}
        await rig.run("streaming")   # warm-up (at the first rate)
        for _ in range(spec["repeats"]):
            rows["compute_only"].append(await rig.run("compute_only"))
            for text in spec["links"]:    # re-shaped in place, so load drifts hit every rate alike
                netns.reshape(spec["shaped"], Link.parse(text))
                for mode in ("then_send", "streaming"):
                    rows.setdefault(f"{text}/{mode}", []).append(await rig.run(mode))
                # the link's ceiling for one TCP stream from Python, right after: the same bytes
                rows.setdefault(f"{text}/socket", []).append(socket_stream(
                    spec["nodes"]["decode"], SINK_PORT, 1 << 20, -(-rig.kv_bytes // (1 << 20)), spec["wire"]))
    await rig.links.close()
    return {"rows": rows, "kv_bytes": rig.kv_bytes, "prompt_len": len(rig.tokens),
            "num_layers": rig.num_layers, "nodes": spec["nodes"]}


class LinkPrefill:
    """The worker's prefill (the stage engine on an in-memory store) with its KV going over the
    link to the decode on the other node: one prefill in any mode, with the CPU it took."""

    def __init__(self, spec: dict, session):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        from mooncake_lite.bench.pd.roles import BLOCK
        from mooncake_lite.model.runner import ModelRunner
        from mooncake_lite.model.weights import build_model
        from mooncake_lite.prefill.engine import StageEngine
        from mooncake_lite.prefill.kv_sender import DecodeLinks
        from mooncake_lite.prefill.store_io import MemoryStore
        n, self.spec, self.session, self.decode = spec["prompt_len"], spec, session, _Decode(spec["decode_http"])
        model = build_model(spec["model"])
        runner = ModelRunner(model, num_blocks=2 * (n // BLOCK + 2), block_size=BLOCK)
        layer_bytes = runner.cache.kv[0].numel() // runner.cache.num_blocks * runner.cache.kv.element_size()
        self.stage = StageEngine(runner, MemoryStore((0, model.args.num_layers), layer_bytes), ThreadPoolExecutor(1),
                                 write_back=False)
        self.links = DecodeLinks(None, request_timeout_s=600.0)   # a slow link queues a whole prompt's KV
        self.tokens = torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        self.kv_bytes, self.num_layers = n * model.args.kv_bytes_per_token(runner.dtype), model.args.num_layers
        self._ids = iter(range(10**9))

    async def run(self, mode: str) -> dict:
        t0, loop0 = os.times(), time.thread_time()
        row = await self._run_mode(mode)
        t1 = os.times()
        # user (Python, torch) and system (syscalls, and packet work the kernel charges to us);
        # this thread runs the event loop (sending), the executor's thread the layers
        return {**row, "cpu_s": t1.user + t1.system - t0.user - t0.system, "sys_s": t1.system - t0.system,
                "loop_cpu_s": time.thread_time() - loop0}

    async def _run_mode(self, mode: str) -> dict:
        from mooncake_lite.bench.pd.overlap import NullSender, prefill_once
        from mooncake_lite.bench.pd.roles import announce
        from mooncake_lite.prefill.kv_sender import KVSender
        if mode == "compute_only":
            return await prefill_once(self.stage, NullSender(), self.tokens, self.spec["chunk"], 0)
        tid = f"link-{mode}-{next(self._ids)}"
        resp = await announce(self.session, self.decode, tid, len(self.tokens))
        client = await self.links.get(self.spec["decode_data"])
        sender = (_timed_then_send(self.spec["decode_pid"]) if mode == "then_send" else KVSender)(client, tid)
        meter = Wire(self.spec["wire"])
        try:
            row = meter.done(await prefill_once(self.stage, sender, self.tokens, self.spec["chunk"], 0))
            return {**row, **getattr(sender, "cpu", {})}
        finally:
            await resp.read()
            resp.release()


def _timed_then_send(decode_pid: int) -> type:
    """Compute, then send; with the CPU seconds each end spends on the tail, the stream alone."""
    from mooncake_lite.bench.pd.overlap import ThenSendSender
    from mooncake_lite.bench.store.limits import process_cpu

    class TimedThenSend(ThenSendSender):
        cpu: dict[str, float] = {}

        async def end(self, *args) -> None:
            mine, theirs = time.process_time(), process_cpu(decode_pid)
            try:
                await super().end(*args)
            finally:
                self.cpu = {"sender_cpu_s": time.process_time() - mine,
                            "receiver_cpu_s": process_cpu(decode_pid) - theirs}
    return TimedThenSend


def summarize_pd(out: dict, links: Sequence[Link]) -> dict:
    """Best-of figures (other load only adds time) and the shares they give, per rate."""
    rows, kv = out["rows"], out["kv_bytes"]
    # compute alone: compute-only runs, and the compute phase of compute-then-send runs (no KV
    # moves until their last layer), so a busy machine leaves more chances to see it undisturbed
    held = [r["compute_s"] for key, rs in rows.items() if key.endswith("/then_send") for r in rs]
    compute = min([r["ttft_s"] for r in rows["compute_only"]] + held)
    res = {"prompt_len": out["prompt_len"], "num_layers": out["num_layers"], "kv_bytes": kv, "nodes": out["nodes"],
           "compute_alone_s": compute, "compute_alone_runs": [r["ttft_s"] for r in rows["compute_only"]],
           "compute_alone_cpu_s": min(r["cpu_s"] for r in rows["compute_only"]),
           "compute_alone_sys_s": min(r["sys_s"] for r in rows["compute_only"]),
           "compute_alone_loop_cpu_s": min(r["loop_cpu_s"] for r in rows["compute_only"]), "links": {}}
    for link in links:
        res["links"][str(link)] = link_figures(link, *(rows[f"{link}/{mode}"] for mode in ("then_send", "streaming",
                                                                                         "socket")), kv, res)
    return res


def link_figures(link: Link, then: list[dict], stream: list[dict], sock: list[dict], kv: int, alone: dict) -> dict:
    """One rate's figures from its runs (compute-then-send, streaming, plain socket) beside the
    compute-alone figures in ``alone``."""
    compute = alone["compute_alone_s"]
    transfer = kv * 8 / link.rate_bps
    e2e = min(r["ttft_s"] for r in stream)
    best = min(range(len(then)), key=lambda i: then[i]["tail_s"])
    tail = then[best]["tail_s"]
    exposed_tail = min(r["tail_s"] for r in stream)
    stream_cpu = min(r["cpu_s"] for r in stream)
    return {
        "rate_bps": link.rate_bps, "transfer_at_rate_s": transfer,
        "end_to_end_s": e2e, "end_to_end_runs": [r["ttft_s"] for r in stream],
        "exposed_s": e2e - compute, "hidden_share": 1 - (e2e - compute) / transfer,
        "goal_hidden_80pct": 1 - (e2e - compute) / transfer >= HIDDEN_GOAL,
        # end-to-end is at least the transfer itself: a link slower than compute caps the share
        "hideable_share": min(1.0, compute / transfer),
        "stream_tail_s": tail, "stream_link_share": share(kv, link.rate_bps, tail),
        "stream_wire_over_payload": min(r["wire_bytes"] for r in then) / kv,
        "stream_drops": sum(r["drops"] for r in then + stream),
        "goal_share_90pct": share(kv, link.rate_bps, tail) >= SHARE_GOAL,
        # CPU seconds each end spent on the stream's tail (best run): per-frame Python costs
        "tail_sender_cpu_s": then[best]["sender_cpu_s"], "tail_receiver_cpu_s": then[best]["receiver_cpu_s"],
        "socket_link_share": max(share(r["bytes"], link.rate_bps, r["seconds"]) for r in sock),
        "exposed_tail_s": exposed_tail, "tail_hidden_share": 1 - exposed_tail / tail,
        # what streaming costs the prefill in CPU, as if it all delayed compute (one core)
        "stream_extra_cpu_s": stream_cpu - alone["compute_alone_cpu_s"],
        "cpu_hidden_share": 1 - (exposed_tail + max(0.0, stream_cpu - alone["compute_alone_cpu_s"])) / transfer,
        "compute_while_streaming_s": min(r["compute_s"] for r in stream),
        "streaming_cpu_s": stream_cpu, "then_send_cpu_s": min(r["cpu_s"] for r in then),
        "stream_extra_sys_s": min(r["sys_s"] for r in stream) - alone["compute_alone_sys_s"],
        "stream_extra_loop_cpu_s": min(r["loop_cpu_s"] for r in stream) - alone["compute_alone_loop_cpu_s"],
        "then_send_s": min(r["ttft_s"] for r in then)}


def render_pd(res: dict) -> str:
    lines = [f"mooncake bench pd --link {' / '.join(res['links'])}: prefill on node1, decode on node2; "
             f"{machine_text(res['machine'])}; best of "
             f"{res['repeats']} runs",
             "hidden = 1 - (end-to-end - compute alone) / transfer at the rate (goal >= 80%); stream share = "
             f"KV bytes / (rate x compute-then-send tail) (goal >= 90%, ceiling {PAYLOAD_PER_FRAME:.1%} at MTU 1500)"]
    for name, p in res["models"].items():
        lines.append(f"\n{name}: {p['prompt_len']} tokens, {p['kv_bytes'] / 1e6:.1f} MB of KV over {p['num_layers']} "
                     f"layers; compute alone {p['compute_alone_s'] * 1e3:.0f} ms")
        for text, r in p["links"].items():
            lines += [f"  {text}: transfer at the rate {r['transfer_at_rate_s'] * 1e3:.0f} ms; end-to-end streaming "
                      f"{r['end_to_end_s'] * 1e3:.0f} ms (+{r['exposed_s'] * 1e3:.0f} ms) -> hidden "
                      f"{r['hidden_share']:.0%} ({'ok' if r['goal_hidden_80pct'] else 'MISS'})"
                      + (f"; at most {r['hideable_share']:.0%} can be: the transfer outlasts compute"
                         if r["hideable_share"] < 1 else ""),
                      f"    compute-then-send {r['then_send_s'] * 1e3:.0f} ms, its tail "
                      f"{r['stream_tail_s'] * 1e3:.0f} ms -> stream share {r['stream_link_share']:.1%} "
                      f"({'ok' if r['goal_share_90pct'] else 'MISS'}), "
                      f"wire/payload {r['stream_wire_over_payload']:.3f}, drops {r['stream_drops']}; a plain socket "
                      f"stream of the same bytes: {r['socket_link_share']:.1%}",
                      f"    CPU on the tail: sender {r['tail_sender_cpu_s'] * 1e3:.0f} ms, receiver (decode) "
                      f"{r['tail_receiver_cpu_s'] * 1e3:.0f} ms",
                      f"    load-independent: streaming's own tail {r['exposed_tail_s'] * 1e3:.0f} ms + the CPU it "
                      f"added to the prefill {r['stream_extra_cpu_s'] * 1e3:.0f} ms "
                      f"({r['stream_extra_sys_s'] * 1e3:.0f} ms of it in the kernel, "
                      f"{r['stream_extra_loop_cpu_s'] * 1e3:.0f} ms in the event loop's thread) -> "
                      f"hidden {r['cpu_hidden_share']:.0%}"]
    return "\n".join(lines)
