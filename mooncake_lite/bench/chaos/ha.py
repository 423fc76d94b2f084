"""``mooncake bench chaos --conductors N``: conductors behind HAProxy, one killed, then etcd, under load.

    mooncake bench chaos --conductors 2                  # tiny preset: 1 prefill, 1 decode, 1 store
    mooncake bench chaos --conductors 2 --runs 3 --json  # and goodput with 1, 2 and 3 conductors
    mooncake bench chaos --conductors 2 --prefill 2 --decode 2 --runs 3 --replay TRACE --no-kills
                                                         # that goodput on a trace replay, and simulated (ha_replay.py)

It starts etcd (its own, on loopback), the conductors with ``--discovery``, one store and the
instances found through etcd, and HAProxy in front (``rig.py``), then, with the chaos load
(``load.py``: ``--concurrency`` streams one after the other, plus a one-token probe every
``--probe-every-s``) through HAProxy:

* **goodput** (with ``--runs``): HAProxy in front of 1, 2, then 3 of the conductors (every
  conductor has the whole view; only the balanced ones take requests), the load for
  ``--goodput-s``: completed requests/s and their TTFT p50; the rounds interleave the three so
  the machine's drift is shared, and each count gets its mean and spread (min-max);
* **conductor kill**: SIGKILL to conductor c1 ``--lead-s`` into the load; over ``--window-s``:
  streams in flight at the kill that failed, requests started after it that failed (goal 0),
  the time until every new request succeeds (to the first token of the first probe sent after
  the last one that failed) and when HAProxy's checks marked it down;
* **etcd kill**: the same with etcd (the last step): serving goes on from the last view.
"""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mooncake_lite.bench.chaos import rig
from mooncake_lite.bench.chaos.load import Load, Outcome, load_flags, phase_figures
from mooncake_lite.bench.options import Options, build_parser, flag, freeze
from mooncake_lite.bench.report import emit
from mooncake_lite.common.launch import RoleProcess
from mooncake_lite.common.ports import free_port

TOKEN = "bench-chaos-ha"
COMMON = ("--host", "127.0.0.1", "--cluster-token", TOKEN, "--block-size", "16")


@dataclass
class Cluster:
    """etcd, the conductors by name (c1, c2, ...), their ports, the instances and the store."""
    a: Options
    etcd: rig.Etcd
    ports: dict[str, int]
    conductors: dict[str, RoleProcess] = field(default_factory=dict)
    others: list[RoleProcess] = field(default_factory=list)

    @property
    def discovery(self) -> tuple[str, str]:
        return "--discovery", f"etcd://127.0.0.1:{self.etcd.client}"

    def start_conductor(self, name: str) -> RoleProcess:
        self.conductors[name] = RoleProcess.start(
            "conductor", *COMMON, "--model", self.a.model, "--port", str(self.ports[name]), *self.discovery,
            "--dead-after", "3s", "--rebuild-wait", "10s", "--admission", "none",
            "--ttft-slo-factor", str(self.a.ttft_slo_factor), "--tbt-slo-factor", str(self.a.tbt_slo_factor), name=name,
            timeout=self.a.ready_timeout_s)
        return self.conductors[name]

    def stop(self) -> None:
        for proc in [*self.others, *self.conductors.values()]:
            proc.stop()
        self.etcd.close()


def start(a: Options, num_conductors: int) -> Cluster:
    etcd = rig.Etcd()
    etcd.start()
    cluster = Cluster(a, etcd, {f"c{i}": free_port() for i in range(1, num_conductors + 1)})
    data = [str(free_port()) for _ in range(a.prefill)]   # a store per prefill: placement has a cache to choose by
    profile = () if a.replay else ("--no-profile",)   # a replay's placement and simulator need the cost models
    model = ("--model", a.model, "--threads", "1", *profile, "--heartbeat-interval", "0.2", "--port", "0",
             *cluster.discovery)
    starts = [lambda n=n: cluster.start_conductor(n) for n in cluster.ports]
    wait = a.ready_timeout_s
    starts += [lambda d=d: RoleProcess.start("store", *COMMON, "--port", "0", "--data-port", d, "--dram", "256MiB",
                                             *cluster.discovery, name=f"store-{d}", timeout=wait) for d in data]
    starts += [lambda i=i: RoleProcess.start("prefill", *COMMON, *model, "--store", f"127.0.0.1:{data[i]}",
                                             name=f"prefill-{i}", timeout=wait) for i in range(a.prefill)]
    starts += [lambda i=i: RoleProcess.start("decode", *COMMON, *model, "--tbt-slo-factor", str(a.tbt_slo_factor),
                                             name=f"decode-{i}", timeout=wait)
               for i in range(a.decode)]
    with ThreadPoolExecutor(len(starts)) as pool:   # at once: a prefill retries its store until it is up
        futures = [pool.submit(s) for s in starts]
    conductors = list(cluster.conductors.values())
    cluster.others = [f.result() for f in futures if f.exception() is None and f.result() not in conductors]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        cluster.stop()
        raise failed[0]
    return cluster


def goodput(cluster: Cluster, a: Options) -> dict[str, dict]:
    """Completed requests/s and TTFT p50 of the chat load with 1, 2 and 3 conductors, ``--runs`` rounds."""
    def measure(url: str, _round: int, _n: int) -> dict[str, float | None]:
        with Load(url + "/v1", a.model, concurrency=a.concurrency, max_tokens=a.max_tokens,
                  hang_s=a.hang_s, probe_every_s=1.0) as load:   # probes apart, not counted
            start = time.monotonic()
            load.resume()
            time.sleep(a.goodput_s)
            load.pause()
            took = time.monotonic() - start
        ok = [o for o in load.outcomes if o.kind == "ok"]
        ttfts = [o.first_token - o.start for o in ok if o.first_token]
        return {"goodput_rps": len(ok) / took, "ttft_p50_s": statistics.median(ttfts) if ttfts else None}
    return {str(n): rig.spread(r) for n, r in rig.interleaved(cluster.ports, a.runs, measure).items()}


def kill(cluster: Cluster, a: Options, victim: str) -> dict:
    """SIGKILL to ``victim`` (a conductor's name, or ``etcd``) under load through HAProxy."""
    proxy = rig.balanced(dict(list(cluster.ports.items())[:a.conductors]))
    marked: dict[str, float] = {}
    try:
        with Load(proxy.url + "/v1", a.model, concurrency=a.concurrency, max_tokens=a.max_tokens, hang_s=a.hang_s,
                  probe_every_s=a.probe_every_s) as load:
            load.resume()
            time.sleep(a.lead_s)
            baseline, t0 = len(load.probes), time.monotonic()
            if victim == "etcd":
                cluster.etcd.kill()
            else:
                cluster.conductors[victim].proc.kill()
                threading.Thread(target=_watch_down, args=(proxy, victim, marked), daemon=True).start()
            time.sleep(a.window_s)
            load.pause()
    finally:
        proxy.close()
    outcomes, probes = load.outcomes, load.probes
    figures = phase_figures([o for o in outcomes if o.end >= t0], probes[baseline:], t0, probes[:baseline])
    failed = [o for o in [*outcomes, *probes] if o.kind != "ok" and o.end >= t0]
    return {"victim": victim, "in_flight_failed": sum(o.start < t0 for o in failed),
            "new_failed": sum(o.start >= t0 for o in failed), "new_requests": _started_after(outcomes, probes, t0),
            "all_new_succeed_s": figures["service_restored_s"], "haproxy_down_s": _since(marked.get("down"), t0),
            "ttft_p50_before_s": figures["ttft_p50_before_s"], "ttft_p50_after_s": figures["ttft_p50_after_s"],
            "errors": figures["errors"]}


def _started_after(outcomes: list[Outcome], probes: list[Outcome], t0: float) -> int:
    return sum(o.start >= t0 for o in [*outcomes, *probes])


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def _watch_down(proxy: rig.HAProxy, name: str, marked: dict[str, float]) -> None:
    while proxy.status().get(name) == "UP":
        time.sleep(0.02)
    marked["down"] = time.monotonic()


def say(text: str) -> None:
    print(f"[chaos --conductors] {text}", file=sys.stderr, flush=True)


def run(a: Options) -> dict:
    say("starting etcd, the conductors, the stores and the instances")
    cluster = start(a, max(a.conductors, 3 if a.runs else 2))
    try:
        result: dict = {"model": a.model, "conductors": a.conductors, "prefill": a.prefill, "decode": a.decode,
                        "load": {"concurrency": a.concurrency, "max_tokens": a.max_tokens}}
        if a.runs and a.replay:
            from mooncake_lite.bench.chaos.ha_replay import replay_goodput
            say(f"trace replay with 1, 2 and 3 conductors, {a.runs} round(s), then the simulator")
            result["replay"] = replay_goodput(cluster.ports, a, TOKEN)
        elif a.runs:
            say(f"goodput with 1, 2 and 3 conductors, {a.runs} round(s)")
            result["goodput"] = goodput(cluster, a)
        if a.kills:
            say("conductor c1 killed under load")
            result["kills"] = [kill(cluster, a, "c1")]
            cluster.start_conductor("c1")
            say("etcd killed under load")
            result["kills"].append(kill(cluster, a, "etcd"))   # last: nothing after needs it back
    finally:
        cluster.stop()
    return result


def render(res: dict) -> str:
    lines = [f"chaos --conductors {res['conductors']}: {res['model']}, {res['prefill']} prefill, {res['decode']} decode"]
    if "kills" in res or "goodput" in res:
        lines += [f"chat load: {res['load']['concurrency']} streams of {res['load']['max_tokens']} tokens through HAProxy"]
    if "kills" in res:
        lines += ["", f"{'killed':<8}{'in-flight failed':>17}{'new failed':>16}{'all new ok after s':>20}"
                      f"{'haproxy down s':>16}{'probe TTFT p50 before/after':>29}"]
    for k in res.get("kills", []):
        lines.append(f"{k['victim']:<8}{k['in_flight_failed']:>17}{str(k['new_failed']) + '/' + str(k['new_requests']):>16}"
                     f"{_s(k['all_new_succeed_s']):>20}{_s(k['haproxy_down_s']):>16}"
                     f"{_s(k['ttft_p50_before_s']) + '/' + _s(k['ttft_p50_after_s']):>29}")
        lines += [f"    {e}" for e in k["errors"][:3]]
    for n, g in res.get("goodput", {}).items():
        lines.append(f"{n} conductor(s): goodput {_s(g['goodput_rps']['mean'])} req/s (runs {g['goodput_rps']['runs']}), "
                     f"TTFT p50 {_s(g['ttft_p50_s']['mean'])} s (runs {g['ttft_p50_s']['runs']})")
    if "replay" in res:
        from mooncake_lite.bench.chaos.ha_replay import render_replay
        lines += render_replay(res["replay"])
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


FLAGS = (
    flag("--conductors", type=int, default=2, help="conductors behind HAProxy for the kills"),
    flag("--model", default="tiny"),
    flag("--prefill", type=int, default=1),
    flag("--decode", type=int, default=1),
    flag("--runs", type=int, default=0, help="goodput rounds with 1, 2 and 3 conductors (0: none)"),
    flag("--goodput-s", type=float, default=15.0, help="load per goodput run"),
    *load_flags(0.25, 3.0, 8.0, "load after the kill"),
    flag("--ready-timeout-s", type=float, default=600.0, help="for each process to start (a loaded box is slow)"),
    flag("--replay", default=None, metavar="TRACE", help="with --runs: goodput on a replay of this trace's "
         "first requests instead of the chat load, and the simulator on the same slice (ha_replay.py)"),
    flag("--replay-requests", type=int, default=24, help="the slice: the trace's first N requests"),
    flag("--replay-speed", type=float, default=0.06, help="the slice's speed (0.06: 6%% of the recorded rate)"),
    flag("--ttft-slo-factor", type=float, default=10.0, help="the conductors' relative TTFT SLO "
         "(decode refusals); a replay's, made absolute as bench fidelity does: this many times the median prefill alone"),
    flag("--tbt-slo-factor", type=float, default=5.0, help="the same for TBT (the conductors' and the decodes' own "
         "check): this many times one step alone"),
    flag("--output-dir", default="chaos-ha-results", help="a replay's exported cost model (costs.json) and the "
         "slice as the simulator ran it (sim_trace.jsonl)"),
    flag("--no-kills", dest="kills", action="store_false", help="only the goodput runs"),
    flag("--json", action="store_true"),
)


def main(argv) -> int:
    parser = build_parser("mooncake bench chaos --conductors N", __doc__.split("\n\n")[0], FLAGS)
    a = freeze(parser.parse_args(list(argv)), "ChaosHAOptions")
    if a.conductors < 2:
        parser.error(f"--conductors must be at least 2 (one is killed), got {a.conductors}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # unwinds: the processes started are stopped
    emit(run(a), render, as_json=a.json)
    return 0
